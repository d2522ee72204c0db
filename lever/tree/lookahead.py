"""Drafting ahead: rows the draft runs while the target verifies, and the next tree's start from them.

While the target verifies a tree the CPU mostly waits on flash, so TreeExpand has the draft
expand more nodes meanwhile (`[tree_expand] lookahead_nodes`): the next cycle's root is the
target's token after the last accepted node, a child of one of the tree's leaves or one of the
candidates left outside it, with a probability about its gain. So `request` expands, by gain,
the tree's unexpanded nodes and the best candidates, which join as nodes past the sent tree.
When the target has answered, `carry_for` finds the new root among them (or nothing, when the
guess missed) and `adopt` starts the next tree from its rows and their children at no drafting
cost; only the draft's cache rows carry over (the Draft stage keeps them pending).

Only nodes at least `lookahead_min_gain` likely to be reached are drafted ahead: each round is
a draft forward's compute on a core the pass could use, and the next root is one exact token,
so of all rows drafted ahead a later tree used 2-10% (code.txt, budget 0: `lever run --json`'s
`ahead_used_share`), and drafting ahead by gain alone cost more CPU, and time, than it saved
(docs/measurements.md, 'Drafting ahead only what is likely').
"""

from __future__ import annotations

import heapq

import attrs
import numpy as np

from lever.dataflow.messages import Accepted, ExpandRequest


@attrs.define
class Lookahead:
    """One tree's part in drafting ahead: rows it took over from the last tree's, and what it
    drafted ahead itself."""

    beside: bool = False  # drafting ahead has cores of its own: it may use the whole pass, not its idle time
    idle_value: float = 0.0  # seconds of drafting saved per second of idle compute in the pass (0: no drafting ahead)
    # the most drafting ahead can spend in one pass (its node cap, in rounds): idle time past it is worth nothing
    usable_s: float = float("inf")
    carried: dict[tuple[int, int], int] = attrs.field(factory=dict)  # (parent row, token) -> row drafted ahead
    spent_s: float = 0.0  # estimated drafting time spent ahead of this tree's pass
    n_ahead: int = 0  # nodes expanded ahead
    n_used: int = 0  # nodes of this tree that came drafted ahead

    def carried_row(self, nodes, parent: int, token: int) -> int | None:
        """The row drafted ahead for `token` below `parent`, if the last tree drafted it."""
        r = nodes.row[parent]
        return self.carried.get((r, token)) if r >= 0 else None


def request(b, time_left_s: float = float("inf")) -> ExpandRequest | None:
    """The next round drafted ahead of `b` (a TreeBuilder whose tree was sent), or None when the
    node cap or the pass's idle time is used, or when the round would outlast the pass
    (`time_left_s`, as the cost model expects it): a forward still running when the target
    answers delays the next cycle."""
    cfg, ahead, nodes = b.config, b.ahead, b.nodes
    n = min(cfg.round_nodes, cfg.lookahead_nodes - ahead.n_ahead)
    if n <= 0:
        return None
    b.picking = b.heap  # ahead, the draft expands its own candidates
    # the n likeliest things to expand: unexpanded tree nodes and candidates, by gain
    leaves = [(-nodes.gain[i], i) for i in range(b.n_sent) if nodes.row[i] < 0]
    best = heapq.nsmallest(n, leaves + [(c.neg_gain, -1 - k) for k, c in enumerate(heapq.nsmallest(n, b.heap))])
    best = [(g, i) for g, i in best if -g >= cfg.lookahead_min_gain]  # in gain order: a prefix
    # a forward's cost grows slowly with its batch: take the batch with the most gain per second
    gains = np.cumsum([-g for g, _ in best])
    if gains.size == 0:
        return None
    size = 1 + int(np.argmax([gains[k - 1] / b.cost.expand_s(k) for k in range(1, gains.size + 1)]))
    step_s = b.cost.expand_s(size)
    # drafting ahead on the verification's cores: the idle time less what the pass lost
    # waiting for cores held by drafting ahead lately (measured online; 0 from a profile)
    budget_s = b.cost.verify_s(b.n_sent) if ahead.beside else b.cost.idle_s(b.n_sent) - b.cost.pass_delay_s
    if ahead.spent_s + step_s > budget_s or step_s > time_left_s:
        return None  # past the time the pass leaves the compute units idle, or past its end
    chosen: list[int] = []
    for _, i in best[:size]:
        if i >= 0:
            chosen.append(i)
        else:  # candidates leave the heap in gain order, as `best` took them
            c = b.best_candidate()
            if c is None:
                break
            chosen.append(b.take(c))
    ahead.spent_s += b.cost.expand_s(len(chosen))
    ahead.n_ahead += len(chosen)
    return attrs.evolve(b.request(chosen), ahead=True)


def carry_for(prev, acc: Accepted) -> tuple[int, ...]:
    """Rows `prev` (the last cycle's TreeBuilder) drafted ahead that the next tree starts from:
    the new root (the target's token after the last accepted node) and its expanded subtree;
    () when the guess missed."""
    nodes = prev.nodes
    last = acc.keep[-1] if acc.keep else -1
    if last < 0 or nodes.row[last] < 0:
        return ()
    root = next((i for i in range(prev.n_sent, len(nodes))
                 if nodes.parents[i] == last and nodes.tokens[i] == acc.tokens[-1] and nodes.row[i] >= 0), None)
    if root is None:
        return ()
    inside = {root}
    for i in range(root + 1, len(nodes)):  # parents come before children
        if nodes.parents[i] in inside and nodes.row[i] >= 0:
            inside.add(i)
    return tuple(sorted(nodes.row[i] for i in inside))


def adopt(b, prev, carry: tuple[int, ...]) -> None:
    """`b`, the next tree (its root added), takes over the rows `prev` drafted ahead, renumbered
    from 0 as the draft renumbers them; the root, node 0, is the first of them."""
    new_row = {old: i for i, old in enumerate(carry)}
    for old, i in new_row.items():
        node = prev.nodes.node_of_row[old]
        p = prev.nodes.parents[node]
        if i:
            b.ahead.carried[(new_row.get(prev.nodes.row[p], -1), prev.nodes.tokens[node])] = i
        b.proposals[i] = prev.proposals[old]
    b.nodes.set_row(0, 0)
    b.n_pending = len(carry)
    b.absorb_row(0)
