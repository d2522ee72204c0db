"""Several conversations kept between requests: their KV rows copied out of the live caches.

Beside lever.pipelines.compose's KVState, below the API (lever.api.Session uses it): one pair of
live caches, the memory plan's, holds the conversation being generated; when another one takes
them over, the one leaving is copied out (its rows only, not the caches' capacity) into this
cache, and a conversation that comes back is copied in again, so its next turn prefills only
what is new. Entries belong to one client (a server's API key) and are never matched across
clients; the cache is bounded by bytes, least recently used out first, and its bound is part of
the memory plan the server prints. Copying a conversation in costs a memcpy of its rows
(milliseconds), a prefill of them costs a pass of the target per chunk.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import attrs
import numpy as np

from lever.pipelines.compose import KVState

MIN_REUSE_TOKENS = 8  # a shorter shared prefix (a BOS and a system line) is not worth a copy


@attrs.frozen
class KVSnapshot:
    """The first rows of both models' caches and the tokens they stand for."""

    ids: tuple[int, ...]
    target: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] = attrs.field(eq=False)  # (k, v) per layer
    draft: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None = attrs.field(eq=False)

    @property
    def nbytes(self) -> int:
        parts = [*self.target[0], *self.target[1], *(() if self.draft is None else (*self.draft[0], *self.draft[1]))]
        return sum(a.nbytes for a in parts)

    @classmethod
    def of(cls, kv: KVState, ids: Sequence[int]) -> KVSnapshot:
        n = kv.n_rows

        def rows(cache):
            return tuple(a[:n].copy() for a in cache.k), tuple(a[:n].copy() for a in cache.v)

        return cls(tuple(ids[:n]), rows(kv.target), rows(kv.draft) if kv.draft is not None else None)

    def restore(self, kv: KVState) -> None:
        """Into `kv`'s caches (the live ones): their first rows become this conversation's."""
        n = len(self.ids)
        for cache, saved in ((kv.target, self.target), (kv.draft, self.draft)):
            if cache is None or saved is None:
                continue
            for live, kept in zip((*cache.k, *cache.v), (*saved[0], *saved[1])):
                live[:n] = kept
            cache.n_rows = n
        kv.n_rows = n


def shared(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


@attrs.define
class PrefixCache:
    """Conversations by client, each client's least recently used out first once its bytes pass
    its share: `capacity_bytes` split evenly into `shares` (a server's API keys), so no client's
    conversations push out another's, and none can tell from its own hits what another does."""

    capacity_bytes: int  # now: a falling memory cap lowers it (resize)
    shares: int = 1
    planned_bytes: int = attrs.field(default=attrs.Factory(lambda s: s.capacity_bytes, takes_self=True))
    entries: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # (client, n) -> KVSnapshot
    used_bytes: int = 0
    hits: int = 0
    _next: int = 0
    _by_client: collections.Counter = attrs.field(factory=collections.Counter)  # bytes each client holds
    _lock: threading.Lock = attrs.field(factory=threading.Lock, eq=False)  # a server's slots take and put at once

    @property
    def share_bytes(self) -> int:
        return self.capacity_bytes // max(self.shares, 1)

    def resize(self, capacity_bytes: int) -> None:
        """Holds at most `capacity_bytes` (never past the planned capacity) from now on: each
        client's oldest entries leave until its bytes fit its new share (a memory cap that fell)."""
        with self._lock:
            self.capacity_bytes = max(0, min(capacity_bytes, self.planned_bytes))
            for client in [c for c, n in self._by_client.items() if n > self.share_bytes]:
                while self._by_client[client] > self.share_bytes:
                    old = self.entries.pop(next(k for k in self.entries if k[0] == client))
                    self.used_bytes -= old.nbytes
                    self._by_client[client] -= old.nbytes

    def take(self, client: object, ids: Sequence[int], at_least: int = 0) -> KVSnapshot | None:
        """The entry of `client` sharing the longest prefix with `ids`, if longer than both
        `at_least` and MIN_REUSE_TOKENS; it leaves the cache (the live caches hold it now)."""
        with self._lock:
            return self._take(client, ids, at_least)

    def _take(self, client: object, ids: Sequence[int], at_least: int) -> KVSnapshot | None:
        best, best_n = None, max(at_least, MIN_REUSE_TOKENS - 1)
        for key, snap in self.entries.items():
            if key[0] == client and (n := shared(snap.ids, ids)) > best_n:
                best, best_n = key, n
        if best is None:
            return None
        self.hits += 1
        snap = self.entries.pop(best)
        self.used_bytes -= snap.nbytes
        self._by_client[client] -= snap.nbytes
        return snap

    def put(self, client: object, snap: KVSnapshot) -> None:
        """Keeps `snap` for `client`, in place of its entries `snap` begins with (the same prompt
        again is kept once); the client's oldest entries leave until its bytes fit its share (one
        bigger than the share is not kept). Other clients' entries are not touched."""
        with self._lock:
            self._put(client, snap)

    def _put(self, client: object, snap: KVSnapshot) -> None:
        if snap.nbytes > self.share_bytes or not snap.ids:
            return
        for key in [k for k, s in self.entries.items() if k[0] == client and shared(s.ids, snap.ids) == len(s.ids)]:
            old = self.entries.pop(key)  # a prefix of this one (the same prompt again): this one serves it too
            self.used_bytes -= old.nbytes
            self._by_client[client] -= old.nbytes
        self.entries[(client, self._next)] = snap
        self._next += 1
        self.used_bytes += snap.nbytes
        self._by_client[client] += snap.nbytes
        while self._by_client[client] > self.share_bytes:
            key = next(k for k in self.entries if k[0] == client)  # its oldest
            old = self.entries.pop(key)
            self.used_bytes -= old.nbytes
            self._by_client[client] -= old.nbytes
