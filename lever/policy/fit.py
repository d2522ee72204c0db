"""Fitting the pruning predictor and TreeExpand's acceptance table from recorded trees.

`lever calibrate` (lever/cli/calibrate.py) runs the configured speculative pipeline unpruned
with a `Recorder` as PrunedVerify's observer: for every tree node with children and at each
candidate layer m, the logit-lens logits of the node's candidates (children and shadows) and
the draft's probabilities, and at the last layer the target's own token at every node. Here,
on the fitting part of the records, per layer: the predictor's correction (a three-parameter
multinomial logit, concave, by Newton's method) and the draft-probability-to-acceptance table;
on the held-out rest, tokens/s for each (m, threshold) from the cost model (the measured cycle
minus the verification compute pruning saves, accepted tokens cut where the target's path
meets a pruned node), the best kept, and predicted against observed acceptance per depth.
"""

from __future__ import annotations

import time

import attrs
import numpy as np

from lever.dataflow.messages import TokenTree, children_of
from lever.model.transformer import Model
from lever.policy.acceptance import AcceptanceTable
from lever.policy.predictor import Correction, candidates, lens_by_node, prune_by_scores, scores

THRESHOLDS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)  # tried on the held-out part; 0: no pruning
HELD_OUT_SHARE = 0.34  # prompts kept out of fitting
TPS_TIE = 0.005  # estimated tokens/s this close to the best count as a tie (the estimate is not finer)
MAX_DEPTH_REPORTED = 8


@attrs.define
class TreeRecord:
    """One verified tree, as calibration saw it."""

    tree: TokenTree
    labels: np.ndarray  # (n_nodes,) the target's token at each node
    lens: dict[int, dict[int, np.ndarray]] = attrs.field(factory=dict)  # layer -> node -> (n_cand,) lens logits
    cycle_s: float = 0.0  # wall time from this tree's pass to the next one's


@attrs.define
class Recorder:
    """PrunedVerify's observer during calibration runs."""

    model: Model
    layers: tuple[int, ...]
    trees: list[TreeRecord] = attrs.field(factory=list)
    _pending: dict[int, dict[int, np.ndarray]] = attrs.field(factory=dict)
    _t_last: float = 0.0

    def __call__(self, layer: int, tree: TokenTree, x: np.ndarray) -> None:
        if tree.n_nodes <= tree.n_given:  # prefill or a lone root: nothing to score
            return
        kids = children_of(tree)
        if layer in self.layers:
            m = self.model
            lens = lens_by_node(tree, kids, x, m.output_norm, m.spec.rms_eps, m.output)
            self._pending[layer] = {n: z for n, (_, _, _, z) in lens.items()}
        if layer == self.model.spec.n_layer - 1:
            now = time.perf_counter()
            if self.trees and self._t_last:
                self.trees[-1].cycle_s = now - self._t_last
            self._t_last = now
            labels = np.argmax(self.model.logits(x), axis=1)
            self.trees.append(TreeRecord(tree, labels, self._pending))
            self._pending = {}


def on_target_path(rec: TreeRecord, alive: np.ndarray | None = None) -> np.ndarray:
    """(n_nodes,) bool: nodes the target's greedy walk reaches (through alive nodes only)."""
    tree, kids = rec.tree, children_of(rec.tree)
    reached = np.zeros(tree.n_nodes, bool)
    node = tree.n_given - 1
    reached[: tree.n_given] = True
    while True:
        nxt = next((c for c in kids[node] if tree.tokens[c] == rec.labels[node] and (alive is None or alive[c])), None)
        if nxt is None:
            return reached
        reached[nxt], node = True, nxt


def examples(recs: list[TreeRecord], layer: int):
    """Per scored node: (lens logits, draft probs, label index or -1 for none, child nodes)."""
    for rec in recs:
        kids = children_of(rec.tree)
        for node, z in rec.lens.get(layer, {}).items():
            toks, q, n_kids = candidates(rec.tree, kids, node)
            hit = np.flatnonzero(toks == rec.labels[node])
            yield rec, node, z, q, int(hit[0]) if hit.size else -1, kids[node]


def fit_correction(data: list[tuple[np.ndarray, np.ndarray, int]], iters: int = 50) -> Correction:
    """Maximum likelihood of the label among candidates + "none", logits a*z + b*log q (none: c)."""
    if not data:
        return Correction()
    width = max(z.size for z, _, _ in data) + 1
    f = np.zeros((len(data), width, 3))  # features of each option: (z, log q, is-none)
    valid = np.zeros((len(data), width), bool)
    label = np.zeros(len(data), int)
    for i, (z, q, y) in enumerate(data):
        k = z.size
        f[i, :k, 0], f[i, :k, 1] = z, np.log(np.maximum(q, 1e-9))
        f[i, k, 2] = 1.0
        valid[i, : k + 1] = True
        label[i] = y if y >= 0 else k
    z_max = max(np.abs(f[..., 0]).max(), 1e-9)
    f[..., 0] /= z_max  # z in [-1, 1]: a well-conditioned start
    theta = np.array([1.0, 1.0, 0.0])
    fy = f[np.arange(len(data)), label]
    for _ in range(iters):
        s = np.where(valid, f @ theta, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        mean = np.einsum("nk,nkj->nj", p, f)
        grad = (fy - mean).sum(axis=0)
        cov = np.einsum("nk,nki,nkj->ij", p, f, f) - np.einsum("ni,nj->ij", mean, mean)
        step = np.linalg.solve(cov + 1e-6 * np.eye(3), grad)
        theta += step
        if np.abs(step).max() < 1e-7:
            break
    return Correction(float(theta[0] / z_max), float(theta[1]), float(theta[2]))


def fit_table(recs: list[TreeRecord]) -> AcceptanceTable:
    """Draft p -> acceptance, from the children of nodes the target's walk reached, as
    TreeExpand learns online: acceptance given the parent was reached, so that multiplied
    along a path it estimates the chance of reaching the node (easy stretches of code make
    consecutive acceptances correlated; the target's token at unreached nodes would bias it)."""
    cal = AcceptanceTable()
    for rec in recs:
        kids = children_of(rec.tree)
        reached = on_target_path(rec)
        for node in np.flatnonzero(reached):
            toks, q, n_kids = candidates(rec.tree, kids, node)
            for rank, (c, t) in enumerate(zip(kids[node], toks[:n_kids])):
                cal.observe(float(q[rank]), _rank(rec.tree, node, t), bool(t == rec.labels[node]))
    return cal


def _rank(tree: TokenTree, node: int, tok: int) -> int:
    drafted = tree.drafts.get(node)
    if drafted is None:
        return 1
    where = np.flatnonzero(drafted.tokens == tok)
    return int(where[0]) if where.size else 1


def depth_report(recs: list[TreeRecord], cal: AcceptanceTable) -> list[dict]:
    """Per depth: mean predicted acceptance (calibrated conditional probabilities multiplied
    along the path) against the share of nodes the target's path reached."""
    pred: dict[int, list[float]] = {}
    obs: dict[int, list[bool]] = {}
    for rec in recs:
        tree, kids = rec.tree, children_of(rec.tree)
        reached = on_target_path(rec)
        depth = tree.depths() - (tree.n_given - 1)
        path_p = np.ones(tree.n_nodes)
        for node in range(tree.n_nodes):
            toks, q, n_kids = candidates(tree, kids, node)
            for k, c in enumerate(kids[node]):
                path_p[c] = path_p[node] * cal(float(q[k]), _rank(tree, node, int(toks[k])))
                if 1 <= depth[c] <= MAX_DEPTH_REPORTED:
                    pred.setdefault(int(depth[c]), []).append(float(path_p[c]))
                    obs.setdefault(int(depth[c]), []).append(bool(reached[c]))
    return [{"depth": d, "nodes": len(pred[d]), "predicted": float(np.mean(pred[d])),
             "observed": float(np.mean(obs[d]))} for d in sorted(pred)]


def evaluate(recs: list[TreeRecord], layer: int, corr: Correction, threshold: float, max_share: float,
             cost) -> dict:
    """What pruning at (layer, threshold) would have done to these trees."""
    tokens = tokens_pruned = 0
    late = late_pruned = 0
    time_s = time_pruned_s = 0.0
    n_layer = cost.n_layer
    for rec in recs:
        tree, kids = rec.tree, children_of(rec.tree)
        s = np.ones(tree.n_nodes)
        for node, z in rec.lens.get(layer, {}).items():
            toks, q, n_kids = candidates(tree, kids, node)
            s[kids[node]] = scores(z, q, corr)[:n_kids]
        alive = (prune_by_scores(tree, s, threshold, max_share, cost, layer) if threshold > 0
                 else np.ones(tree.n_nodes, bool))
        n, n_alive = tree.n_nodes, int(alive.sum())
        tokens += int(on_target_path(rec)[tree.n_given:].sum()) + 1
        tokens_pruned += int(on_target_path(rec, alive)[tree.n_given:].sum()) + 1
        late += n * (n_layer - 1 - layer)
        late_pruned += n_alive * (n_layer - 1 - layer)
        cycle_s = rec.cycle_s or cost.verify_s(n)
        time_s += cycle_s
        time_pruned_s += cycle_s - cost.verify_s(n) + cost.verify_s(n, n_alive, layer)
    return {"layer": layer, "threshold": threshold, "tokens_per_pass": tokens / max(len(recs), 1),
            "tokens_per_pass_pruned": tokens_pruned / max(len(recs), 1),
            "late_token_layers_cut": 1 - late_pruned / max(late, 1),
            "token_layers_cut": (late - late_pruned) / max(late * n_layer / max(n_layer - 1 - layer, 1), 1),
            "tps": tokens / max(time_s, 1e-9), "tps_pruned": tokens_pruned / max(time_pruned_s, 1e-9)}


def choose(grid: list[dict]) -> dict:
    """The (layer, threshold) with the best estimated tokens/s; among those within
    TPS_TIE of it, the one that cuts most verification compute: the estimate leans on the cost
    model, and a device whose verification is costlier than profiled gains more from pruning."""
    top = max(g["tps_pruned"] for g in grid)
    near = [g for g in grid if g["tps_pruned"] >= top * (1 - TPS_TIE)]
    return max(near, key=lambda g: (g["token_layers_cut"], g["tps_pruned"]))
