"""A session on disk: the conversation, the token ids both KV caches hold, and their rows.

msgpack, like profiles and artifacts, written atomically (a temp file beside it, renamed), and
read back field by field: a file that is not one, of another model pair, or whose arrays do
not fit the caches is refused with one line naming the file and the field. Only the rows in
use are written (a 1,000-token Qwen2.5 1.5B conversation is about 28 MB for the target).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import numpy as np

from lever.errors import LeverError, regular_file
from lever.gguf.identity import ModelIdentity
from lever.pipelines.compose import KVState

FORMAT = "lever-session"
VERSION = 1


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
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(msgpack.packb(doc, use_bin_type=True))
        os.replace(tmp, p)
    except OSError as e:
        raise LeverError(f"{p}: cannot write the session ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)


def read(path: str | os.PathLike, *, kv: KVState, target: ModelIdentity, draft: ModelIdentity | None,
         n_vocab: int) -> tuple[list[dict], list[int]]:
    """Fills `kv` (fresh caches of this engine) from the file; the conversation and ids."""
    p = regular_file(path, "file")
    try:
        doc = msgpack.unpackb(p.read_bytes(), raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise LeverError(f"{p}: not a saved session ({type(e).__name__})") from None

    def fail(field: str, why: str) -> LeverError:
        return LeverError(f"{p}: {field}: {why}")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise LeverError(f"{p}: not a saved session (no format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise fail("version", f"{doc.get('version')!r}, this Lever reads {VERSION}")
    if doc.get("target") != [target.size_bytes, target.sha256_first_mib]:
        raise fail("target", f"saved with another target model than {target.path}")
    want_draft = [draft.size_bytes, draft.sha256_first_mib] if draft is not None else None
    if doc.get("draft") != want_draft:
        raise fail("draft", "saved with another draft model (or none)")
    messages = doc.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
        raise fail("messages", "must be a list of {role, content} strings")
    n = doc.get("n_rows")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= kv.target.n_ctx:
        raise fail("n_rows", f"must be an integer in [0, {kv.target.n_ctx}], got {n!r}")
    ids = doc.get("ids")
    if not isinstance(ids, list) or len(ids) != n or not all(isinstance(t, int) and 0 <= t < n_vocab for t in ids):
        raise fail("ids", f"must be {n} token ids in [0, {n_vocab})")
    for field, cache in (("target_kv", kv.target), ("draft_kv", kv.draft)):
        rows = doc.get(field)
        if cache is None or n == 0:
            continue
        if not isinstance(rows, dict):
            raise fail(field, "missing")
        for part, arrays in (("k", cache.k), ("v", cache.v)):
            blobs = rows.get(part)
            if not isinstance(blobs, list) or len(blobs) != len(arrays):
                raise fail(f"{field}.{part}", f"must hold {len(arrays)} layers")
            for i, (blob, a) in enumerate(zip(blobs, arrays)):
                want = n * a[0].size * a.itemsize
                if not isinstance(blob, bytes) or len(blob) != want:
                    raise fail(f"{field}.{part}[{i}]", f"must be {want} bytes")
                rows_i = np.frombuffer(blob, a.dtype).reshape((n, *a.shape[1:]))
                if not np.isfinite(rows_i).all():
                    raise fail(f"{field}.{part}[{i}]", "holds numbers that are not finite")
                a[:n] = rows_i
    kv.n_rows = n
    kv.target.n_rows = n
    if kv.draft is not None:
        kv.draft.n_rows = n
    return messages, ids
