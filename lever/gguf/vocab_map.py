"""Which draft token is which target token, when the two files' token tables differ.

It sits between loading and drafting: Engine.open pairs the two files once (`pair_vocabularies`:
refuse, warn, or map; compare_vocabularies below is its checking half), compose
hands the map to the Drafter (stages/draft.py), which feeds the draft the target's tokens in the
draft's own ids and turns what the draft proposes back into target ids. Everything downstream
(TreeExpand, verification, Accept, both KV caches: one row per target token) sees target ids only.
Output stays lossless whatever the map, since the target verifies every token by id; the map
decides only how often the draft's proposals are right.

Tokens are matched by their strings, and only between tokenizers that cut text alike: the same
kind, pre-tokenizer and merges (SentencePiece: the same text tokens and scores). Within one kind a
token's string spells its decoded bytes one to one (byte-level BPE's stand-in characters,
SentencePiece's ▁ and <0xHH> byte tokens; a special token is its own text), so equal strings are
equal bytes and the match needs no decoding: a dict from string to target id, built once.

Tokenizers that cut the same text differently are refused, not mapped. Mapping alone would run
(lossless), but the draft would be fed sequences its own tokenizer never makes and would propose
its own cuts, which the target picks only where the cuts agree: the silent slowdown the check
exists to prevent. Drafting across tokenizers needs token-level intersection (draft in the
draft's tokens, verify the target's tokenization of the same text: HF transformers #35029, vLLM
#38174), where draft and target rows no longer align one to one: a change to TreeExpand and both
caches, not to the vocabulary.
"""

from __future__ import annotations

import operator
import time

import attrs
import numpy as np

from lever.errors import LeverError, shown
from lever.gguf.file import GGUFFile
from lever.gguf.tokenizer import _ID_KEYS, _NO_TOKEN, NORMAL, SPACE_MARK, byte_level_chars

_STAND_IN_CHARS = 64  # a stand-in is looked for among the first this many characters of a token


@attrs.frozen
class VocabFigures:
    """What share of each vocabulary the map covers (the run summary's vocabulary line)."""

    draft_tokens: int
    draft_mapped: int  # draft tokens with a target counterpart: the ones it may propose
    target_tokens: int
    target_reachable: int  # target tokens some draft token maps to: the ones that can be drafted
    stand_ins: int  # target tokens with no draft counterpart, fed to the draft as another token
    build_ms: float  # building the map, at load


@attrs.frozen(eq=False)
class VocabMap:
    """Draft ids <-> target ids. Injective both ways, so a draft distribution restricted to the
    mapped tokens is a distribution over target ids, token for token."""

    to_target: np.ndarray  # (n_draft,) int64: the target id of each draft token, -1 when none
    to_draft: np.ndarray  # (n_target,) int64: the draft id fed for each target token (a stand-in where none)
    unmapped: np.ndarray  # draft ids with no counterpart: masked before the draft's top-k, never proposed
    mapped_draft: np.ndarray  # draft ids that map, ascending
    mapped_target: np.ndarray  # their target ids, in the same order (the scatter of the draft's q)
    figures: VocabFigures

    @property
    def n_draft(self) -> int:
        return self.to_target.size

    @property
    def n_target(self) -> int:
        return self.to_draft.size


@attrs.frozen
class _Table:
    """One file's token table as the pairing reads it (straight from the metadata: the target's was
    checked by its Tokenizer, and nothing but these lists is read of the draft's)."""

    path: str
    model: str | None
    pre: str | None
    tokens: list
    types: np.ndarray  # NORMAL where the file has no types
    scores: np.ndarray | None
    merges: list | None
    meta: dict

    @classmethod
    def of(cls, f: GGUFFile) -> _Table | None:
        m = f.metadata
        tokens = m.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:  # GGUFFile decodes every string of an array to a str
            return None
        n = len(tokens)
        types = m.get("tokenizer.ggml.token_type")
        usable = isinstance(types, np.ndarray) and types.dtype.kind in "iu" and len(types) == n
        types = types.astype(np.int32) if usable else np.full(n, NORMAL, np.int32)
        scores = m.get("tokenizer.ggml.scores")
        scores = scores if isinstance(scores, np.ndarray) and scores.dtype.kind in "fiu" and len(scores) == n else None
        merges = m.get("tokenizer.ggml.merges")
        model, pre = m.get("tokenizer.ggml.model"), m.get("tokenizer.ggml.pre")
        return cls(path=str(f.path), model=model if isinstance(model, str) else None,
                   pre=pre if isinstance(pre, str) else None, tokens=tokens, types=types, scores=scores,
                   merges=merges if isinstance(merges, list) else None, meta=m)

    def special_id(self, key: str):
        """A special id as comparable: None for absent or "no such token" (-1 however stored);
        anything odd compares as its repr."""
        v = self.meta.get(f"tokenizer.ggml.{key}")
        if v is None or (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and int(v) in _NO_TOKEN):
            return None
        return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else shown(repr(v), 30)


def _cut_differently(t: _Table, d: _Table) -> str | None:
    """Why the two tokenizers would cut the same text into other tokens (figures), or None."""
    if t.model != d.model:
        return f"tokenizer kinds differ (draft {d.model!r}, target {t.model!r})"
    if t.model == "gpt2":
        if (t.pre or "default") != (d.pre or "default"):
            return f"pre-tokenizers differ (draft {d.pre!r}, target {t.pre!r})"
        ma, mb = t.merges or [], d.merges or []
        if ma != mb:  # the merges are strings, not ids: a permuted or padded table keeps them
            n = sum(map(operator.ne, ma, mb)) + abs(len(ma) - len(mb))
            return f"merges differ ({n:,} of {max(len(ma), len(mb)):,})"
        return None
    if t.model == "llama":  # SentencePiece: the merges are made from the text tokens and their scores
        def text_scores(x: _Table) -> dict:
            normal = np.flatnonzero(x.types == NORMAL).tolist()
            scores = x.scores.tolist() if x.scores is not None else [0.0] * len(x.tokens)
            return {x.tokens[i]: scores[i] for i in normal}
        a, b = text_scores(t), text_scores(d)
        if a != b:
            n = sum(1 for k, s in a.items() if b.get(k) != s) + sum(1 for k in b if k not in a)
            return f"text tokens or their scores differ ({n:,} of {max(len(a), len(b)):,})"
    return None


def _spelled(text: str, kind: int, model: str | None) -> str:
    """A token's text as the draft's text tokens spell it (a special token is plain text)."""
    if kind == NORMAL:
        return text
    if model == "gpt2":
        chars = byte_level_chars()
        return "".join(chars[b] for b in text.encode()[: 4 * _STAND_IN_CHARS])
    return text.replace(" ", SPACE_MARK) if model == "llama" else text


def _stand_in(text: str, draft_ids: dict, fallback: int) -> int:
    """The draft token fed for a target token the draft does not have (a padding row, a special
    token only the target knows): the longest start of its text that the draft has as a token,
    which is what the draft's own BPE would most likely begin it with (merges grow toward long
    tokens); else `fallback` (the draft's unknown token, or id 0). The draft's cache needs exactly
    one row per target token, so it is always exactly one draft id; what the draft makes of it
    only changes its later proposals, never the output."""
    for n in range(min(len(text), _STAND_IN_CHARS), 0, -1):
        i = draft_ids.get(text[:n])
        if i is not None:
            return i
    return fallback


def _build(t: _Table, d: _Table) -> VocabMap:
    t0 = time.perf_counter()
    a, b = t.tokens, d.tokens
    nt, nd = len(a), len(b)
    n = min(nt, nd)
    # Tables of one tokenizer mostly agree id for id (padding appended, a few special tokens
    # renamed): those ids map to themselves, and only the rest go through a dict from string to
    # target id. A table with every id moved (the worst case) puts them all through it.
    probe = np.linspace(0, n - 1, min(n, 64)).astype(np.int64).tolist()
    if any(a[i] == b[i] for i in probe):
        same = np.fromiter(map(operator.eq, a, b), bool, n)
    else:  # no id in place among 64 spread over the table: skip the comparison of every one
        same = np.zeros(n, bool)
    to_target, to_draft = np.full(nd, -1, np.int64), np.full(nt, -1, np.int64)
    kept = np.flatnonzero(same)
    to_target[kept] = to_draft[kept] = kept
    if kept.size < max(nt, nd):
        moved = np.flatnonzero(~same)
        t_rest, d_rest = np.concatenate([moved, np.arange(n, nt)]), np.concatenate([moved, np.arange(n, nd)])
        # on duplicate strings the last id wins, as in the tokenizer's own table
        target_ids = dict(zip(a, range(nt))) if not kept.size else dict(zip(map(a.__getitem__, t_rest.tolist()),
                                                                            t_rest.tolist()))
        wanted = b if not kept.size else list(map(b.__getitem__, d_rest.tolist()))
        found = np.fromiter(map(target_ids.get, wanted, [-1] * len(wanted)), np.int64, len(wanted))
        ok = found >= 0
        to_target[d_rest[ok]] = found[ok]
        to_draft[found[ok]] = d_rest[ok]
        # one draft token per target token: of draft tokens spelled alike, the one fed maps
        clash = d_rest[ok][to_draft[found[ok]] != d_rest[ok]]
        to_target[clash] = -1
    missing = np.flatnonzero(to_draft < 0)
    if missing.size:
        unk = d.special_id("unknown_token_id")
        fallback = unk if isinstance(unk, int) and 0 <= unk < nd else 0
        types = t.types.tolist()
        spelled = [_spelled(a[i], types[i], d.model) for i in missing.tolist()]
        # the draft tokens that could be a stand-in: one pass over its table for the few starts wanted
        starts = {w[:k] for w in spelled for k in range(1, min(len(w), _STAND_IN_CHARS) + 1)}
        hits = np.flatnonzero(np.fromiter(map(starts.__contains__, b), bool, nd)).tolist()
        draft_ids = dict(zip(map(b.__getitem__, hits), hits))
        to_draft[missing] = [_stand_in(w, draft_ids, fallback) for w in spelled]
    mapped_draft = np.flatnonzero(to_target >= 0)
    figures = VocabFigures(nd, int(mapped_draft.size), nt, int(mapped_draft.size), int(missing.size),
                           (time.perf_counter() - t0) * 1e3)
    return VocabMap(to_target, to_draft, np.flatnonzero(to_target < 0), mapped_draft, to_target[mapped_draft], figures)


def pair_vocabularies(target: GGUFFile, draft: GGUFFile) -> tuple[VocabMap | None, list[str]]:
    """The map from the draft's token ids to the target's (None: the same table, ids mean the
    same, nothing to map) and the warnings to print, one line each; tokenizers that would cut
    text differently are refused with one line and figures.

    - the same token strings at the same ids: no map, and the drafting path is the one it was.
    - the same tokenizer (kind, pre-tokenizer, merges) but another table (ids permuted, padding
      rows, special tokens only one of them has): mapped by string.
    - another tokenizer: refused (why: this module's docstring).
    - special ids (BOS, EOS, EOT...) that do not map to each other: warned, the draft may
      mispredict where text ends.
    Cost, once per pairing: identical tables are one list comparison; tables that mostly agree id
    for id (padding rows, a few renamed tokens) add an id-by-id comparison and a dict of the rest;
    a table with every id moved (the worst case) costs a dict of all the strings and as many
    lookups (measured on the Qwen2.5-Coder pair: docs/measurements.md, 'Vocabulary map cost').
    """
    names = f"draft {draft.path} and target {target.path}"
    t, d = _Table.of(target), _Table.of(draft)
    if t is None or d is None:
        missing = "draft" if d is None else "target"
        return None, [f"{names}: the {missing} has no token table, so Lever cannot check that the pair shares one"]
    why = _cut_differently(t, d)
    if why is not None:
        raise LeverError(f"{names}: {why}: the same text would be cut into other tokens, so the draft's proposals "
                         f"would rarely be the target's (lossless but slow; Lever maps tables of one tokenizer, "
                         f"not across tokenizers): use a draft of the target's tokenizer")
    vmap = None if t.tokens == d.tokens else _build(t, d)
    warnings = []
    moved = []
    for k in _ID_KEYS:
        x, y = t.special_id(k), d.special_id(k)
        if vmap is not None and isinstance(y, int) and 0 <= y < vmap.n_draft:  # compared as target ids
            m = int(vmap.to_target[y])
            if m != x:
                moved.append(f"{k} {y} (target id {m if m >= 0 else 'none'}) vs {x}")
        elif x != y:
            moved.append(f"{k} {y} vs {x}")
    if moved:
        warnings.append(f"{names}: special ids differ ({', '.join(moved)}): the draft may mispredict where text ends")
    return vmap, warnings


def compare_vocabularies(target: GGUFFile, draft: GGUFFile) -> list[str]:
    """Checks that a draft can draft for the target before the pair is used: refuses with one
    line and figures, or returns warnings (one line each) to print.

    Speculation stays lossless whatever the draft proposes (the target verifies every token by
    id), so what is checked is speed: a draft whose ids mean other text than the target's would
    make nearly every proposal wrong. Tables of the same tokenizer whose ids differ (permuted,
    padded, special tokens only one has) are mapped by string (`pair_vocabularies` makes the map
    too); tokenizers that cut text differently (another kind, pre-tokenizer or merges) are
    refused; special ids that do not correspond are warned."""
    return pair_vocabularies(target, draft)[1]
