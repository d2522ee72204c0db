"""A generation seen as it runs: each cycle's tree, the path the target took, and where the
cycle's time went, as events a live page reads (lever.serve.page draws them at `/`).

The engine hands a run's `RunWatch` every span its tracer closes (lever.dataflow.trace), and
the pipeline's taps (lever.dataflow.graph) hand it every tree TreeExpand sends to verification
and every `Accepted` Accept emits (which carries the tree its pass verified): a tree becomes a
"tree" event as its pass starts, and the cycle, once accepted, a "cycle" event, each encoded to
JSON once, in `Watch`: a ring bounded in bytes that readers poll by sequence number, and only
while some reader follows. Nothing here waits on a reader: one that falls behind the ring is
told how many events it missed. Every number in an event is finite (a gain that is not becomes
null).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import attrs
import numpy as np

from lever.dataflow.messages import Accepted, TokenTree
from lever.dataflow.trace import Span

LIVE_BYTES = 4 << 20  # the ring's bound: the newest events (about 1,000 cycles of a 40-node tree)
MAX_NODES = 160  # nodes of one tree an event draws; a bigger tree's rest is counted, not drawn
MAX_SPANS = 400  # spans of one cycle kept for its timeline (a pass of a 28-layer target makes ~90)
PIECE_CHARS = 40  # a token's text is cut to this (a token can stand for a long run of spaces)


@attrs.frozen
class Event:
    seq: int  # its client's own count: 1, 2, ... (lever.serve.page's readers resume from it)
    client: object  # whose generation (a server's API key; None on a server without keys)
    data: str  # the event, JSON


@attrs.define
class Watch:
    """The newest events of every run, for readers: `run(client)` gives a run's recorder,
    `since(seq, client)` the events after `seq` that `client` may read (its own runs' only)."""

    piece: Callable[[int], str]  # a token's text
    max_bytes: int = LIVE_BYTES
    # readers following now (a server's pages): while there are none, cycles are not built,
    # so a server nobody watches pays nothing but the runs' first and last events
    readers: int = 0
    _events: deque = attrs.field(factory=deque)
    _bytes: int = 0
    _seq: Counter = attrs.field(factory=Counter)  # by client: its newest event's number
    _dropped: Counter = attrs.field(factory=Counter)  # by client: its newest event the ring let go
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def run(self, client: object = None) -> RunWatch:
        return RunWatch(self, client)

    def push(self, client: object, body: dict) -> int:
        data = json.dumps(body, ensure_ascii=False, allow_nan=False)
        with self._lock:
            self._seq[client] += 1
            self._events.append(Event(self._seq[client], client, data))
            self._bytes += len(data)
            while self._bytes > self.max_bytes and len(self._events) > 1:
                old = self._events.popleft()
                self._bytes -= len(old.data)
                self._dropped[old.client] = old.seq
            return self._seq[client]

    def since(self, seq: int, client: object = None) -> tuple[list[Event], int, int]:
        """The events after `seq` that `client` may read, the newest of its sequence numbers,
        and how many of its events after `seq` the ring dropped before they were read. Each
        client's events are numbered on their own: nothing here moves with another's runs."""
        with self._lock:
            newest = self._seq[client]
            missed = max(self._dropped[client] - seq, 0)
            found = [e for e in self._events if e.seq > seq and e.client == client]
        return found, newest, missed

    @property
    def n_bytes(self) -> int:
        return self._bytes


@attrs.define
class RunWatch:
    """One run's recorder: the engine calls `begin`, then `span` and `cycle` as they come (from
    the stages' threads), then `end`."""

    hub: Watch
    client: object = None
    t0_s: float = 0.0  # the tracer's clock origin (perf_counter seconds)
    _cycle_start_s: float = 0.0  # when the current cycle began: the previous one's end, on the tracer's clock
    _spans: list[Span] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    spent_s: float = 0.0  # the watch's own time: building and encoding the cycles' events

    def begin(self, *, t0_s: float, pipeline: str, n_prompt: int, n_past: int) -> None:
        self.t0_s, self._cycle_start_s = t0_s, time.perf_counter() - t0_s
        self.hub.push(self.client, {"type": "run", "pipeline": pipeline, "n_prompt": n_prompt, "n_past": n_past})

    def span(self, s: Span) -> None:
        if not self.hub.readers:  # a span per layer and read: nothing kept while nobody reads
            return
        with self._lock:
            if len(self._spans) < MAX_SPANS:
                self._spans.append(s)

    def tree(self, tree: TokenTree) -> None:
        """A tree on its way to verification (a prefill's prompt is not drawn)."""
        if not self.hub.readers or tree.n_given > 1:
            return
        t0 = time.perf_counter()
        self.hub.push(self.client, {"type": "tree", "pass": tree.pass_id, "t_s": round(t0 - self.t0_s, 4),
                                    "n_nodes": tree.n_nodes, "n_drafted": tree.n_nodes - tree.n_given,
                                    "nodes": tree_nodes(tree, self.hub.piece)})
        self.spent_s += time.perf_counter() - t0

    def cycle(self, acc: Accepted) -> None:
        now_s = time.perf_counter() - self.t0_s
        with self._lock:
            spans, self._spans = self._spans, []
        start_s, self._cycle_start_s = self._cycle_start_s, now_s
        if not self.hub.readers:
            return
        self.hub.push(self.client, cycle_event(acc, self.hub.piece, spans, start_s=start_s, end_s=now_s))
        self.spent_s += time.perf_counter() - self.t0_s - now_s

    def end(self, *, stop_reason: str | None, n_tokens: int, tokens_per_pass: float, decode_s: float) -> None:
        self.hub.push(self.client, {"type": "end", "stop": stop_reason, "n_tokens": n_tokens,
                                    "tokens_per_pass": _finite(tokens_per_pass),
                                    "tok_per_s": _finite(n_tokens / decode_s) if decode_s > 0 else None,
                                    "watch_ms": _finite(self.spent_s * 1e3)})


def cycle_event(acc: Accepted, piece: Callable[[int], str], spans: list[Span], *, start_s: float,
                end_s: float) -> dict:
    """One cycle as the page draws it: the tree (a prefill pass's prompt is counted, not drawn),
    which nodes the target kept and which the predictor pruned, the tokens emitted, and the
    cycle's spans with their times in ms from its start."""
    tree, cycle_s = acc.tree, max(end_s - start_s, 1e-9)
    body = {"type": "cycle", "pass": acc.pass_id, "t_s": round(end_s, 4), "cycle_ms": round(cycle_s * 1e3, 3),
            "emitted": [piece(t)[:PIECE_CHARS] for t in acc.tokens], "drafted_kept": acc.drafted_kept,
            # the target's own tokens, after the drafts it took (1, or 0 when the run ended on a draft)
            "own": max(len(acc.tokens) - acc.drafted_kept, 0),
            "done": acc.done, "stop": str(acc.stop_reason) if acc.stop_reason is not None else None}
    if tree is not None:
        body |= {"n_nodes": tree.n_nodes, "n_given": tree.n_given, "n_drafted": tree.n_nodes - tree.n_given,
                 "nodes": [] if tree.n_given > 1 else tree_nodes(tree, piece, acc.keep, acc.pruned)}
    t = acc.timing
    if t is not None:
        body["timing"] = {"compute_ms": round(t.compute_s * 1e3, 3), "wait_ms": round(t.wait_s * 1e3, 3),
                          "read_ms": round(t.read_s * 1e3, 3), "read_mb": round(t.read_bytes / 1e6, 3),
                          "accept_ms": round(t.accept_s * 1e3, 3)}
    body["flash_busy"] = round(_busy(spans, start_s, end_s) / cycle_s, 4)
    body["spans"] = [{"stage": s.stage, "what": s.what, "kind": s.kind,
                      "start_ms": round((s.start_s - start_s) * 1e3, 3), "end_ms": round((s.end_s - start_s) * 1e3, 3)}
                     for s in spans]
    return body


def tree_nodes(tree: TokenTree, piece: Callable[[int], str], keep=(0,), pruned=()) -> list[dict]:
    """The first MAX_NODES nodes (parents come first, so they form a tree): token text, parent,
    gain (the chance the target's walk reaches the node, as TreeExpand estimated it), the draft's
    probability, and state: "kept" (on the accepted path; before verification, the root alone),
    "pruned", or "drafted" (not taken, or not yet verified)."""
    kept, pruned = set(keep), set(pruned)
    gains = tree.gains if tree.gains is not None else np.full(tree.n_nodes, np.nan, np.float32)
    q = tree.q if tree.q is not None else np.full(tree.n_nodes, np.nan, np.float32)
    return [{"parent": int(tree.parents[i]), "text": piece(int(tree.tokens[i]))[:PIECE_CHARS],
             "gain": _finite(float(gains[i])), "q": _finite(float(q[i])),
             "state": "kept" if i in kept else "pruned" if i in pruned else "drafted"}
            for i in range(min(tree.n_nodes, MAX_NODES))]


def _busy(spans: list[Span], start_s: float, end_s: float) -> float:
    """Seconds of [start_s, end_s] in which at least one flash read was under way."""
    busy, reach = 0.0, start_s
    for a, b in sorted((max(s.start_s, start_s), min(s.end_s, end_s)) for s in spans if s.kind == "io"):
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return busy


def _finite(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None
