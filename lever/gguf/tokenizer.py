"""The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, built on `tokenizers`.

It sits between the text the user types or reads and the token ids the model core computes
with: the CLI and the generation loop encode prompts here and turn sampled ids back into
text through StreamDecoder. Two vocab kinds are supported, chosen to reproduce llama.cpp's
own tokenizer id for id: `llama` (SentencePiece BPE with byte fallback, rebuilt as a
`tokenizers` BPE whose merges come from the scores, the way HF converts SentencePiece models)
and `gpt2` (byte-level BPE with the file's merges and the pre-tokenizer regex its
`tokenizer.ggml.pre` names). Decoding works on each token's raw bytes, so streamed text
and whole-sequence text come from the same table and always agree.
"""

from __future__ import annotations

import codecs
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from lever.errors import LeverError, kind_of, shown
from lever.gguf.chat_template import Rendered, special_pattern
from lever.gguf.file import GGUFFile

# GGUF token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_TYPES = (CONTROL, USER_DEFINED, UNKNOWN)  # read as one token wherever their text stands

SPACE_MARK = "\u2581"  # SentencePiece's "▁", which stands for a space inside tokens

# Pre-tokenizer regexes, copied from llama.cpp (llm_tokenizer_bpe) so that words are cut
# where llama.cpp cuts them; the contractions are spelled out case by case there because
# its regex engine lacks (?i:...), and onig accepts that spelling too.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces the previous one made
    ignore_merges: bool = False  # a word that is itself a token is not run through the merges
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_PRE_TOKENIZERS = {
    "default": _PreTokenizer(_DEFAULT_RES),
    "gpt2": _PreTokenizer((_GPT2_RE,)),
    "gpt-2": _PreTokenizer((_GPT2_RE,)),
    "llama-bpe": _PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True),
    "llama3": _PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True),
    "llama-v3": _PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True),
    "qwen2": _PreTokenizer((_QWEN2_RE,)),
}

# Control tokens after which a model has finished: turn and text ends, and the FIM markers that
# start another file. llama.cpp stops on these by name as well as on the ids the metadata marks,
# because converted files often mark only one of them.
_EOG_NAMES = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>",
    "<EOT>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})
_EOG_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id", "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")


@dataclass(frozen=True)
class _Vocab:
    """The tokenizer metadata of one GGUF file, read once and checked (see _read_vocab)."""

    path: str
    model: str
    pre: str | None
    tokens: list[str]
    types: np.ndarray
    scores: np.ndarray | None
    merges: list[str] | None
    ids: dict[str, int | None]  # the special-token ids Lever uses, keyed without the prefix
    flags: dict[str, bool]  # the add_* flags the file sets

    def token_id(self, key: str) -> int | None:
        return self.ids.get(key)

    def flag(self, key: str, default: bool) -> bool:
        return self.flags.get(key, default)

    def fail(self, key: str, why: str) -> LeverError:
        return LeverError(f"{self.path}: tokenizer.ggml.{key} {why}")


MAX_TOKEN_CHARS = 1024  # past any real vocabulary's longest token; SentencePiece merges cost its square
_ID_KEYS = tuple(dict.fromkeys(("unknown_token_id", "bos_token_id", *_EOG_KEYS)))
_NO_TOKEN = (-1, 2**32 - 1, 2**64 - 1)  # llama.cpp writes "no such token" as -1, often in a uint32
_FLAGS = ("add_bos_token", "add_eos_token", "add_space_prefix")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SURROGATES = re.compile("[\ud800-\udfff]")


def _read_vocab(f: GGUFFile) -> _Vocab:
    """The tokenizer metadata, every value checked for type, length and range first: token,
    score and type arrays of one length, known token types, byte tokens that name a byte,
    special ids inside the vocabulary (or -1, none)."""
    path = str(f.path)
    meta = {k[len("tokenizer.ggml.") :]: v for k, v in f.metadata.items() if k.startswith("tokenizer.ggml.")}
    if "model" not in meta or "tokens" not in meta:
        raise LeverError(f"{path}: no tokenizer in the metadata (tokenizer.ggml.model/tokens missing)")

    def fail(key: str, why: str) -> LeverError:
        return LeverError(f"{path}: tokenizer.ggml.{key} {why}")

    for key in ("model", "pre"):
        if key in meta and not isinstance(meta[key], str):
            raise fail(key, f"is {kind_of(meta[key])}, expected a string")
    for key in ("tokens", "merges"):
        if key in meta and not isinstance(meta[key], list):  # string arrays are lists, numeric ones numpy
            raise fail(key, f"is {kind_of(meta[key])}, expected an array of strings")
    if not meta["tokens"]:
        raise fail("tokens", "is empty")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(meta["tokens"])]
    n = len(tokens)
    if max(map(len, tokens)) > MAX_TOKEN_CHARS:
        i = next(i for i, t in enumerate(tokens) if len(t) > MAX_TOKEN_CHARS)
        raise fail(f"tokens[{i}]", f"is {len(tokens[i])} characters long (at most {MAX_TOKEN_CHARS})")

    def array(key: str, kinds: str) -> np.ndarray | None:
        arr = meta.get(key)
        if arr is None:
            return None
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in kinds:
            raise fail(key, f"is {kind_of(arr)}, expected an array of numbers")
        if len(arr) != n:
            raise fail(key, f"has {len(arr)} entries for {n} tokens")
        return arr

    types = array("token_type", "iu")
    if types is None:
        types = np.full(n, NORMAL, np.int32)
    elif (bad := np.flatnonzero((types < 0) | (types > BYTE))).size:
        raise fail(f"token_type[{bad[0]}]", f"= {types[bad[0]]} is not a token type (0-{BYTE})")
    types = types.astype(np.int32)
    scores = array("scores", "fiu")
    if scores is not None:
        with np.errstate(invalid="ignore"):  # a signalling NaN warns as it is widened; it is refused just below
            scores = scores.astype(np.float64)
            bad = np.flatnonzero(~(np.abs(scores) <= 1e30))  # NaN too
        if bad.size:
            raise fail(f"scores[{bad[0]}]", f"= {scores[bad[0]]} is not a usable score")
        scores = scores.astype(np.float32)
    if meta["model"] == "llama":
        for i in np.flatnonzero(types == BYTE).tolist():
            if not _BYTE_TOKEN.fullmatch(tokens[i]):
                raise fail(f"tokens[{i}]", f"{shown(tokens[i], 40)!r} is a byte token but not named <0xHH>")

    ids, flags = _special_ids(meta, n, fail), _flags(meta, fail)
    return _Vocab(path=path, model=meta["model"], pre=meta.get("pre"), tokens=tokens, types=types, scores=scores,
                  merges=meta.get("merges"), ids=ids, flags=flags)


def _special_ids(meta: dict, n: int, fail) -> dict[str, int | None]:
    """The special tokens' ids, each inside the vocabulary (or -1: none)."""
    ids: dict[str, int | None] = {}
    for key in _ID_KEYS:
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(key, f"is {kind_of(value)}, expected a token id")
        if value not in _NO_TOKEN and not 0 <= value < n:
            raise fail(key, f"= {value} is out of range for {n} tokens")
        ids[key] = value if 0 <= value < n else None
    return ids


def _flags(meta: dict, fail) -> dict[str, bool]:
    flags: dict[str, bool] = {}
    for key in _FLAGS:
        value = meta.get(key)
        if value is None:
            continue
        if not (isinstance(value, int) and value in (0, 1)):
            raise fail(key, f"is {kind_of(value)}, expected true or false")
        flags[key] = bool(value)
    return flags


# --- building the `tokenizers` object -------------------------------------------------------


def _spm_merges(tokens: Sequence[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged score first.

    SentencePiece BPE merges whichever adjacent pair forms the highest-scoring token; a
    rank list ordered by that score makes BPE do the same. Mirrors HF's
    SentencePieceExtractor, including its tie order (token id, then the halves' ids).
    """
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-float(scores[i]), i, ids[left], ids[right], left, right))
    found.sort(key=lambda m: m[:4])
    return [(m[4], m[5]) for m in found]


def _build_spm(v: _Vocab) -> HFTokenizer:
    if v.scores is None:
        raise LeverError(f"{v.path}: tokenizer.ggml.model is 'llama' but tokenizer.ggml.scores is missing")
    unk = v.token_id("unknown_token_id")
    model = models.BPE(
        vocab=_vocab_dict(v.tokens),
        merges=_spm_merges(v.tokens, v.scores),
        unk_token=v.tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    hf = HFTokenizer(model)
    replace = normalizers.Replace(" ", SPACE_MARK)
    # tokenizers prepends per segment between special tokens, as llama.cpp does after each one
    if v.flag("add_space_prefix", True):
        hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), replace])
    else:
        hf.normalizer = replace
    strip = [decoders.Strip(" ", 1, 0)] if v.flag("add_space_prefix", True) else []
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(),
                                    *strip])
    return hf


def _pre_tokenizer(v: _Vocab) -> _PreTokenizer:
    name = v.pre or "default"  # llama.cpp's fallback for files converted before `pre` existed
    if name not in _PRE_TOKENIZERS:
        raise v.fail("pre", f"{shown(name, 40)!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})")
    return _PRE_TOKENIZERS[name]


def _build_bpe(v: _Vocab) -> HFTokenizer:
    pre = _pre_tokenizer(v)
    if v.merges is None:
        raise LeverError(f"{v.path}: tokenizer.ggml.model is 'gpt2' but tokenizer.ggml.merges is missing")
    vocab = _vocab_dict(v.tokens)
    cuts = [m.find(" ", 1) for m in v.merges]
    merges = [(m[:c], m[c + 1 :]) for m, c in zip(v.merges, cuts)]
    # checked here, not left to tokenizers: for some vocabularies it panics (a BaseException)
    # on a merge whose join is not a token instead of raising
    bad = next((i for i, ((a, b), c) in enumerate(zip(merges, cuts))
                if c < 1 or not b or a not in vocab or b not in vocab or a + b not in vocab), None)
    if bad is not None:
        _bad_merge(v, vocab, bad, v.merges[bad])
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers raises plain Exception; the checks above should leave nothing for it
        raise v.fail("merges", f"rejected by tokenizers: {shown(' '.join(str(e).split()), 200)}") from None
    hf = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    hf.decoder = decoders.ByteLevel()
    return hf


def _bad_merge(v: _Vocab, vocab: dict[str, int], i: int, merge: str) -> None:
    """Why merge i is not "a b" (cut at the first space after the first character, as llama.cpp
    does) with both halves and their join tokens: else the merge could make an id that is none."""
    cut = merge.find(" ", 1)
    left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else (merge, "")
    if not right:
        raise v.fail(f"merges[{i}]", f"{shown(merge, 40)!r} is not two tokens separated by a space")
    for part in (left, right, left + right):
        if part not in vocab:
            raise v.fail(f"merges[{i}]", f"{shown(merge, 40)!r}: {shown(part, 40)!r} is not a token")


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    # on duplicate strings the last id wins, as in llama.cpp's token_to_id
    return {t: i for i, t in enumerate(tokens)}


def _add_special_tokens(hf: HFTokenizer, v: _Vocab) -> None:
    # matched in the raw text before normalization, like llama.cpp's special-token partition
    kinds = np.isin(v.types, SPECIAL_TYPES)
    specials = [AddedToken(v.tokens[i], special=True, normalized=False) for i in np.flatnonzero(kinds)]
    hf.add_special_tokens(specials)


# --- token bytes ----------------------------------------------------------------------------


def byte_level_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255 (byte-level BPE vocabularies
    spell their tokens with these)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 256
    for b in range(256):
        if b not in chars:
            chars[b], extra = extra, extra + 1
    return [chr(chars[b]) for b in range(256)]


def _byte_level_table() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to the bytes they encode."""
    return {c: b for b, c in enumerate(byte_level_chars())}


def _spm_piece(text: str, kind: int) -> bytes:
    if kind == BYTE and _BYTE_TOKEN.fullmatch(text):
        return bytes([int(text[3:5], 16)])
    if kind == NORMAL:
        return text.replace(SPACE_MARK, " ").encode()
    return text.encode()


def _byte_level_piece(text: str, kind: int, table: dict[str, int]) -> bytes:
    if kind != NORMAL:  # control and user-defined tokens are stored as plain text
        return text.encode()
    try:
        return bytes(table[c] for c in text)
    except KeyError:
        return text.encode()


# --- public API -----------------------------------------------------------------------------


class Tokenizer:
    """Encode text to token ids and back, as the GGUF file's own tokenizer does."""

    def __init__(self, vocab: _Vocab, hf: HFTokenizer) -> None:
        self._vocab = vocab
        self._hf = hf
        self._plain_lock = threading.Lock()  # encode_special_tokens is the HF tokenizer's state
        self.model = vocab.model
        self.vocab_size = len(vocab.tokens)
        self.bos_id = vocab.token_id("bos_token_id")
        self.eos_id = vocab.token_id("eos_token_id")
        self.eos_ids = frozenset(_eog_ids(vocab))
        is_spm = vocab.model == "llama"
        self.add_bos = vocab.flag("add_bos_token", is_spm or _pre_tokenizer(vocab).add_bos)
        self.add_eos = vocab.flag("add_eos_token", False)
        # SentencePiece's space prefix shows up as a leading space; decoding drops it once
        self._strips_leading_space = is_spm and vocab.flag("add_space_prefix", True)

    @classmethod
    def from_gguf(cls, source: GGUFFile | str | os.PathLike) -> Tokenizer:
        """From an open GGUFFile (no second parse of the file), or a path."""
        vocab = _read_vocab(source if isinstance(source, GGUFFile) else GGUFFile(source))
        if vocab.model == "llama":
            hf = _build_spm(vocab)
        elif vocab.model == "gpt2":
            hf = _build_bpe(vocab)
        else:
            raise vocab.fail("model", f"{shown(vocab.model, 40)!r} is not supported (supported: llama, gpt2)")
        _add_special_tokens(hf, vocab)
        return cls(vocab, hf)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_start|>` becomes its one id."""
        # a lone surrogate (undecodable bytes in a command line) cannot be tokenized: it stands for U+FFFD
        with self._plain_lock:
            ids = self._hf.encode(_SURROGATES.sub("\ufffd", text), add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    @cached_property
    def specials(self) -> dict[str, int]:
        """Special-token text -> id: what `encode` reads as one control token wherever it stands."""
        kinds = np.isin(self._vocab.types, SPECIAL_TYPES)
        return {self._vocab.tokens[i]: int(i) for i in np.flatnonzero(kinds)}

    def encode_chat(self, rendered: Rendered) -> list[int]:
        """A rendered conversation's ids: the template's special tokens as control tokens, the
        special-token text that came from the messages (`rendered.foreign`) as plain text."""
        if not rendered.foreign:
            return self.encode(rendered.text, add_bos=False)
        text, foreign, ids, at = rendered.text, set(rendered.foreign), [], 0
        for m in special_pattern(tuple(self.specials)).finditer(text):
            if m.start() in foreign:
                continue
            ids += self._encode_plain(text[at : m.start()])
            ids.append(self.specials[m.group()])
            at = m.end()
        return ids + self._encode_plain(text[at:])

    def _encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with special-token text in it read as text (as the tokenizer splits a
        text at its special tokens, so segments encoded apart equal the whole's)."""
        if not text:
            return []
        with self._plain_lock:
            self._hf.encode_special_tokens = True
            try:
                return self._hf.encode(_SURROGATES.sub("\ufffd", text), add_special_tokens=False).ids
            finally:
                self._hf.encode_special_tokens = False

    def token_text(self, token_id: int) -> str:
        """A token's string as the vocabulary holds it (a special token's name, "<|im_end|>"),
        as chat templates write them."""
        self.check_id(token_id)
        return str(self._vocab.tokens[token_id])

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; control tokens (BOS, EOS, chat markers) and <unk> contribute nothing."""
        ids = list(ids)
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            self.check_id(next(i for i in ids if not 0 <= i < self.vocab_size))
        data = b"".join(self._pieces[i] for i in ids)
        if self._strips_leading_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; a control token gives its own name."""
        self.check_id(token_id)
        return self._bytes[token_id]

    def hf_json(self) -> str:
        """The `tokenizers` definition built from the GGUF (for engines that read one: the
        grammar engine's adapter, lever.model.grammar, checked there against `token_bytes`)."""
        with self._plain_lock:
            return self._hf.to_str()

    def piece(self, token_id: int) -> bytes:
        """What the token adds to decoded text: its bytes, or nothing for the kinds llama.cpp does
        not render (control, unknown, unused)."""
        self.check_id(token_id)
        return self._pieces[token_id]

    @cached_property
    def max_token_bytes(self) -> int:
        """The most text one token stands for: a prompt of n bytes is at least n / this tokens."""
        return max(1, max(map(len, self._bytes)))

    def check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise LeverError(f"{self._vocab.path}: token id {token_id} is out of range [0, {self.vocab_size})")

    @cached_property
    def _bytes(self) -> list[bytes]:
        v = self._vocab
        if v.model == "llama":
            return [_spm_piece(t, k) for t, k in zip(v.tokens, v.types.tolist())]
        table = _byte_level_table()
        return [_byte_level_piece(t, k, table) for t, k in zip(v.tokens, v.types.tolist())]

    @cached_property
    def _pieces(self) -> list[bytes]:
        # what each token adds to decoded text: nothing for the kinds llama.cpp does not render
        hidden = np.isin(self._vocab.types, (CONTROL, UNKNOWN, UNUSED))
        return [b"" if h else b for b, h in zip(self._bytes, hidden.tolist())]

    def __repr__(self) -> str:
        return f"Tokenizer({self.model}, pre={self._vocab.pre}, vocab_size={self.vocab_size}, file={self._vocab.path})"


class StreamDecoder:
    """Turns ids arriving one at a time into text, holding back unfinished UTF-8 sequences.

    The pieces returned by push() and then flush() concatenate to Tokenizer.decode() of the
    same ids. Pass at_start=False when the ids continue text already shown (a completion
    after its prompt), so the leading space of the first word is kept.
    """

    def __init__(self, tokenizer: Tokenizer, *, at_start: bool = True) -> None:
        self._pieces = tokenizer._pieces
        self._check_id = tokenizer.check_id
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = at_start and tokenizer._strips_leading_space

    def push(self, token_id: int) -> str:
        """The text completed by this token, possibly empty."""
        if not 0 <= token_id < len(self._pieces):
            self._check_id(token_id)
        data = self._pieces[token_id]
        if self._strip and data:
            self._strip = False
            if data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is still held back at the end, with an unfinished sequence as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _eog_ids(v: _Vocab) -> set[int]:
    ids = {v.token_id(k) for k in _EOG_KEYS}
    named = np.flatnonzero(v.types == CONTROL).tolist()
    ids.update(i for i in named if v.tokens[i] in _EOG_NAMES)
    ids.discard(None)
    return ids
