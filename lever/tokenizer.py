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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from lever.errors import LeverError
from lever.gguf_file import GGUFFile

# GGUF token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

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
    """The tokenizer metadata of one GGUF file, read once."""

    path: str
    model: str
    pre: str | None
    tokens: list[str]
    types: np.ndarray
    scores: np.ndarray | None
    merges: list[str] | None
    scalars: dict[str, object]  # the non-array tokenizer.ggml.* values, keyed without the prefix

    def token_id(self, key: str) -> int | None:
        # llama.cpp writes "no such token" as -1 stored in a uint32 field
        value = self.scalars.get(key)
        return value if isinstance(value, int) and 0 <= value < len(self.tokens) else None

    def flag(self, key: str, default: bool) -> bool:
        value = self.scalars.get(key)
        return default if value is None else bool(value)


def _read_vocab(f: GGUFFile) -> _Vocab:
    path = str(f.path)
    meta = {k[len("tokenizer.ggml.") :]: v for k, v in f.metadata.items() if k.startswith("tokenizer.ggml.")}
    if "model" not in meta or "tokens" not in meta:
        raise LeverError(f"{path}: no tokenizer in the metadata (tokenizer.ggml.model/tokens missing)")
    for key in ("tokens", "merges"):
        if key in meta and not (isinstance(meta[key], list) and all(isinstance(t, str) for t in meta[key][:1])):
            raise LeverError(f"{path}: tokenizer.ggml.{key} is not an array of strings")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(meta["tokens"])]
    n = len(tokens)
    types = np.asarray(meta["token_type"], np.int32) if "token_type" in meta else np.full(n, NORMAL, np.int32)
    scores = np.asarray(meta["scores"], np.float32) if "scores" in meta else None
    for key, arr in (("token_type", types), ("scores", scores)):
        if arr is not None and len(arr) < n:
            raise LeverError(f"{path}: tokenizer.ggml.{key} has {len(arr)} entries for {n} tokens")
    merges = meta.get("merges")
    scalars = {k: v for k, v in meta.items() if not isinstance(v, (list, np.ndarray))}
    pre = scalars.get("pre")
    return _Vocab(path, str(scalars["model"]), pre and str(pre), tokens, types[:n], None if scores is None else scores[:n], merges, scalars)


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
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return hf


def _pre_tokenizer(v: _Vocab) -> _PreTokenizer:
    name = v.pre or "default"  # llama.cpp's fallback for files converted before `pre` existed
    if name not in _PRE_TOKENIZERS:
        raise LeverError(f"{v.path}: unsupported tokenizer.ggml.pre '{name}' (supported: {', '.join(_PRE_TOKENIZERS)})")
    return _PRE_TOKENIZERS[name]


def _build_bpe(v: _Vocab) -> HFTokenizer:
    pre = _pre_tokenizer(v)
    if v.merges is None:
        raise LeverError(f"{v.path}: tokenizer.ggml.model is 'gpt2' but tokenizer.ggml.merges is missing")
    merges = [tuple(m.split(" ", 1)) for m in v.merges]
    try:
        model = models.BPE(vocab=_vocab_dict(v.tokens), merges=merges, ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers raises plain Exception for a merge naming an unknown token
        raise LeverError(f"{v.path}: bad tokenizer.ggml.merges: {e}") from None
    hf = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    # on duplicate strings the last id wins, as in llama.cpp's token_to_id
    return {t: i for i, t in enumerate(tokens)}


def _add_special_tokens(hf: HFTokenizer, v: _Vocab) -> None:
    # matched in the raw text before normalization, like llama.cpp's special-token partition
    kinds = np.isin(v.types, (CONTROL, USER_DEFINED, UNKNOWN))
    specials = [AddedToken(v.tokens[i], special=True, normalized=False) for i in np.flatnonzero(kinds)]
    hf.add_special_tokens(specials)


# --- token bytes ----------------------------------------------------------------------------


def _byte_level_table() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to the bytes they encode."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _spm_piece(text: str, kind: int) -> bytes:
    if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
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
            raise LeverError(f"{vocab.path}: unsupported tokenizer.ggml.model '{vocab.model}' (supported: llama, gpt2)")
        _add_special_tokens(hf, vocab)
        return cls(vocab, hf)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_start|>` becomes its one id."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; control tokens (BOS, EOS, chat markers) and <unk> contribute nothing."""
        data = b"".join(self._pieces[i] for i in ids)
        if self._strips_leading_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; a control token gives its own name."""
        return self._bytes[token_id]

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
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = at_start and tokenizer._strips_leading_space

    def push(self, token_id: int) -> str:
        """The text completed by this token, possibly empty."""
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

