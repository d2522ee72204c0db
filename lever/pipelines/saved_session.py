"""A session on disk: the conversation, the token ids both KV caches hold, and their rows.

msgpack, like profiles and artifacts, written atomically (a temp file beside it, renamed), and
read back field by field: a file that is not one, of another model pair, or whose arrays do
not fit the caches is refused with one line naming the file and the field. Only the rows in
use are written (a 1,000-token Qwen2.5 1.5B conversation is about 28 MB for the target).
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import msgpack
import numpy as np

from lever.errors import LeverError, shown
from lever.gguf.chat_template import ROLES
from lever.gguf.identity import ModelIdentity
from lever.outputs import atomic_write
from lever.pipelines.compose import KVState
from lever.policy.fields import MAX_COUNT, Fields, read_msgpack

FORMAT = "lever-session"
VERSION = 1
MAX_ROWS = 2**24  # past any model's context (`read` checks the engine's own)
MAX_TEXT_BYTES_PER_TOKEN = 1024  # a conversation's text per cached token, generously (a token is <= ~128 bytes)


def _rows(cache, n: int) -> dict:
    return {"k": [a[:n].tobytes() for a in cache.k], "v": [a[:n].tobytes() for a in cache.v]}


def write(path: str | os.PathLike, *, messages: list[dict], ids: list[int], kv: KVState | None,
          target: ModelIdentity, draft: ModelIdentity | None) -> None:
    p = Path(path)
    n = kv.n_rows if kv is not None else 0
    doc = {"format": FORMAT, "version": VERSION, "target": [target.size_bytes, target.sha256_first_mib],
           "draft": [draft.size_bytes, draft.sha256_first_mib] if draft is not None else None,
           "messages": messages, "ids": list(ids[:n]), "n_rows": n,
           "target_kv": _rows(kv.target, n) if kv is not None else None,
           "draft_kv": _rows(kv.draft, n) if kv is not None and kv.draft is not None else None}
    try:  # a fresh temp name beside it (mkstemp: O_EXCL, so no planted link is followed), renamed
        with atomic_write(p, "wb", "session") as f:
            f.write(msgpack.packb(doc, use_bin_type=True))
    except OSError as e:
        raise LeverError(f"{p}: cannot write the session ({e.strerror or e})") from None


@attrs.frozen
class SavedSession:
    """A session file's contents, checked for everything that needs no engine (`load`)."""

    messages: list[dict]
    ids: list[int]
    n_rows: int
    target: list  # [size in bytes, sha256 of the first MiB]: ModelIdentity's short name
    draft: list | None
    target_kv: dict | None  # {"k": [one bytes blob per layer], "v": [...]}, n_rows rows each
    draft_kv: dict | None


def load(path: str | os.PathLike, *, max_bytes: int | None = None, max_items: int | None = None) -> SavedSession:
    """The session file at path, every field checked for type, shape and range (what `read`
    checks against an engine aside), or one line naming the file and the field. `max_bytes`
    and `max_items` (an engine's bounds, from `read`) are checked before it is decoded."""
    p = Path(path)
    doc = read_msgpack(p, "saved session", max_bytes=max_bytes, max_items=max_items)
    f = Fields(p, "saved session")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise LeverError(f"{p}: not a saved session (no format {FORMAT!r})")
    version = doc.get("version")
    if type(version) is not int or version != VERSION:
        raise f.fail("version", f"{shown(repr(version), 40)}, this Lever reads {VERSION}")

    def identity(field: str) -> list | None:
        v = f.key(doc, field, "")
        if v is None and field == "draft":
            return None
        pair = f.array(v, field, n=2)
        return [f.integer(pair[0], f"{field}[0]"), f.hex_digest(pair[1], f"{field}[1]")]

    target, draft = identity("target"), identity("draft")
    messages = []
    for i, m in enumerate(f.array(f.key(doc, "messages", ""), "messages")):
        m = f.map(m, f"messages[{i}]")
        messages.append({"role": f.string(f.key(m, "role", f"messages[{i}]"), f"messages[{i}].role", choices=ROLES),
                         "content": f.string(f.key(m, "content", f"messages[{i}]"), f"messages[{i}].content",
                                             max_chars=MAX_COUNT)})
    n = f.integer(f.key(doc, "n_rows", ""), "n_rows", 0, MAX_ROWS)
    ids = [f.integer(t, f"ids[{i}]", 0, 2**31) for i, t in enumerate(f.array(f.key(doc, "ids", ""), "ids", n=n))]

    def rows(field: str) -> dict | None:
        v = doc.get(field)
        if v is None:
            return None
        m = f.map(v, field)
        out = {part: f.array(f.key(m, part, field), f"{field}.{part}", max_n=2**20) for part in ("k", "v")}
        for part, blobs in out.items():
            for i, b in enumerate(blobs):
                if not isinstance(b, bytes):
                    raise f.fail(f"{field}.{part}[{i}]", f"is {type(b).__name__}, expected bytes")
        return out

    return SavedSession(messages, ids, n, target, draft, rows("target_kv"), rows("draft_kv"))


def read(path: str | os.PathLike, *, kv: KVState, target: ModelIdentity, draft: ModelIdentity | None,
         n_vocab: int) -> tuple[list[dict], list[int]]:
    """Fills `kv` (fresh caches of this engine) from the file (`load`, then checked against
    this engine's models and caches); the conversation and ids. On any error `kv` is left
    as it was: every check runs before the first row is copied."""
    p = Path(path)
    n_ctx = min(c.n_ctx for c in (kv.target, kv.draft) if c is not None)
    caches = [c for c in (kv.target, kv.draft) if c is not None]
    # the largest file this engine could have written: every cache row, the ids, and the text
    # those tokens stand for with room to spare; nothing in it longer than the context or a model's layers
    rows_bytes = sum(a.nbytes for c in caches for a in (*c.k, *c.v))
    max_bytes = rows_bytes + n_ctx * (9 + MAX_TEXT_BYTES_PER_TOKEN) + (1 << 20)
    max_items = n_ctx + max(len(c.k) for c in caches) + 64
    s = load(p, max_bytes=max_bytes, max_items=max_items)
    f = Fields(p, "saved session")
    if s.target != [target.size_bytes, target.sha256_first_mib]:
        raise f.fail("target", f"saved with another target model than {target.path}")
    if s.draft != ([draft.size_bytes, draft.sha256_first_mib] if draft is not None else None):
        raise f.fail("draft", "saved with another draft model (or none)")
    n = s.n_rows
    if n > n_ctx:
        raise f.fail("n_rows", f"must be an integer in [0, {n_ctx}], got {n}")
    if any(t >= n_vocab for t in s.ids):
        i = next(i for i, t in enumerate(s.ids) if t >= n_vocab)
        raise f.fail(f"ids[{i}]", f"= {s.ids[i]}: must be {n} token ids in [0, {n_vocab})")
    staged = []
    for field, cache, rows in (("target_kv", kv.target, s.target_kv), ("draft_kv", kv.draft, s.draft_kv)):
        if cache is None or n == 0:
            continue
        if rows is None:
            raise f.fail(field, "missing")
        for part, arrays in (("k", cache.k), ("v", cache.v)):
            blobs = rows[part]
            if len(blobs) != len(arrays):
                raise f.fail(f"{field}.{part}", f"must hold {len(arrays)} layers, holds {len(blobs)}")
            for i, (blob, a) in enumerate(zip(blobs, arrays)):
                want = n * a[0].size * a.itemsize
                if len(blob) != want:
                    raise f.fail(f"{field}.{part}[{i}]", f"must be {want} bytes, is {len(blob)}")
                rows_i = np.frombuffer(blob, a.dtype).reshape((n, *a.shape[1:]))
                if not np.isfinite(rows_i).all():
                    raise f.fail(f"{field}.{part}[{i}]", "holds numbers that are not finite")
                staged.append((a, rows_i))
    for a, rows_i in staged:
        a[:n] = rows_i
    kv.n_rows = n
    kv.target.n_rows = n
    if kv.draft is not None:
        kv.draft.n_rows = n
    return s.messages, s.ids
