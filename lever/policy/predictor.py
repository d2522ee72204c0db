"""The pruning predictor: after target layer m, which tree branches the target will not take.

It sits inside PrunedVerify's pass. After layer m each node's hidden state goes through the
target's final norm and the output projection's rows of its candidate tokens only (a logit
lens: a few hundred dot products, not the whole vocabulary), the candidates being the node's
children in the tree plus its shadows, the draft's other proposals there, so that a lone child
does not score 1 by construction. A small correction fitted by `lever calibrate` (a scale on
the lens logits, a weight on the draft's log-probability, the logit of "none of these") turns
them into the probability that each child is the target's choice. Children under the threshold
are pruned with their subtrees, never the backbone (the draft's likeliest chain) and never more
than a share of the tree; pruned nodes skip layers m+1.. and their KV rows are never committed.

Pruning cannot change a token: Accept only descends into nodes that were verified to the end,
and the token at a node comes from that node's own logits, which pruning its children leaves
alone. It can only end an accepted path earlier.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import attrs
import msgpack
import numpy as np

from lever.backends.cpu import native
from lever.dataflow.messages import TokenTree, children_of, likely_path
from lever.errors import LeverError, shown
from lever.gguf.identity import ModelIdentity
from lever.model.finite import NonFiniteError, finite
from lever.outputs import atomic_write
from lever.policy.acceptance import AcceptanceTable
from lever.policy.fields import Fields, read_msgpack

ARTIFACT_SUFFIX = ".lever-predictor.msgpack"


@attrs.frozen
class PredictorConfig:
    """[predictor]: pruning tree branches at a middle layer of the target."""

    enabled: bool = False  # prune with the predictor (needs `lever calibrate`, or layer and weights set here)
    artifact: str = ""  # `lever calibrate`'s artifact; empty: beside the target, <target>.lever-predictor.msgpack
    layer: int = -1  # prune after this target layer; -1: the calibrated one
    threshold: float = -1.0  # prune a child whose score is below; -1: the calibrated one
    max_prune_share: float = 0.5  # never prune more than this share of a tree's nodes in one pass
    cost_aware: bool = True  # prune a branch only when the time it saves beats the tokens it may take (cost model)

    def __attrs_post_init__(self):
        if not 0.0 <= self.max_prune_share <= 1.0:
            raise LeverError(f"[predictor] max_prune_share: must be in [0, 1], got {self.max_prune_share}")
        if self.threshold != -1.0 and not 0.0 <= self.threshold <= 1.0:
            raise LeverError(f"[predictor] threshold: must be in [0, 1] (or -1: calibrated), got {self.threshold}")


@attrs.frozen
class Correction:
    """Lens logit z and draft probability q of a candidate -> score logit a*z + b*log q;
    "none of the candidates" has logit c."""

    scale: float = 1.0  # a
    draft_weight: float = 0.0  # b
    none_logit: float = 0.0  # c


def backbone(tree: TokenTree, kids: list[list[int]]) -> set[int]:
    """The draft's likeliest chain from the root: never pruned."""
    return set(range(tree.n_given)) | set(likely_path(tree, kids, tree.n_given - 1))


def candidates(tree: TokenTree, kids: list[list[int]], node: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, draft probabilities, n children): the node's children first, then its shadows.
    A child's probability is its draft p at the node: from the draft's proposals there, else the
    tree's q of the child (a free source's node: its source's own confidence)."""
    toks = [int(tree.tokens[c]) for c in kids[node]]
    known: dict[int, float] = {}
    drafted = tree.drafts.get(node)
    if drafted is not None:
        known = {int(t): float(p) for t, p in zip(drafted.tokens, drafted.probs)}
    probs = [known.get(t, float(tree.q[c]) if tree.q is not None else 1.0) for t, c in zip(toks, kids[node])]
    shadows = [(t, p) for t, p in known.items() if t not in set(toks)]
    return (np.asarray(toks + [t for t, _ in shadows], np.int64),
            np.asarray(probs + [p for _, p in shadows], np.float64), len(toks))


def lens_logits(x: np.ndarray, tokens: np.ndarray, norm: np.ndarray, eps: float, output) -> np.ndarray:
    """Logit-lens logits of `tokens` at hidden state x (n_embd,): final norm, then those rows of
    the output projection only."""
    h = native.rmsnorm(x[None, :].astype(np.float32), norm, eps)[0]
    rows = output.dequantize(tokens)
    return rows @ h  # (n_candidates,)


def lens_by_node(tree: TokenTree, kids: list[list[int]], x: np.ndarray, norm: np.ndarray, eps: float,
                 output) -> dict[int, tuple[np.ndarray, np.ndarray, int, np.ndarray]]:
    """For every node with children (past the given chain): (candidate tokens, draft
    probabilities, n children, lens logits). One norm over those nodes and one dequantization
    of every candidate row, not one per node (`lens_logits` is the one-node form)."""
    nodes = [n for n in range(tree.n_given - 1, tree.n_nodes) if kids[n]]
    if not nodes:
        return {}
    cands = [candidates(tree, kids, n) for n in nodes]
    vocab, where = np.unique(np.concatenate([c[0] for c in cands]), return_inverse=True)
    h = native.rmsnorm(np.ascontiguousarray(x[nodes], np.float32), norm, eps)  # (n_scored, n_embd)
    rows = output.dequantize(vocab)
    out, start = {}, 0
    for j, (node, (toks, q, n_kids)) in enumerate(zip(nodes, cands)):
        out[node] = (toks, q, n_kids, rows[where[start : start + toks.size]] @ h[j])
        start += toks.size
    return out


def scores(z: np.ndarray, q: np.ndarray, corr: Correction) -> np.ndarray:
    """Probabilities (n_candidates,) that each candidate is the target's token."""
    s = corr.scale * z + corr.draft_weight * np.log(np.maximum(q, 1e-9))
    s = np.append(s, corr.none_logit)
    s -= s.max()
    e = np.exp(s)
    return (e / e.sum())[:-1]


@attrs.define
class Predictor:
    """Scores children at layer `layer` and prunes the hopeless ones."""

    layer: int
    threshold: float
    correction: Correction
    norm: np.ndarray  # (n_embd,) the target's output norm
    eps: float
    output: object  # the target's output projection (lever.backends.cpu.layer.Weight)
    max_prune_share: float = 0.5
    cost: object = None  # the cost model (lever.policy.cost_model): prune only what pays; None: by score alone
    scoring_s: float = 0.0  # what scoring and deciding cost per pass (moving average)
    n_scored: int = 0  # children scored, over the run
    n_pruned: int = 0  # nodes pruned (subtrees included), over the run

    def child_scores(self, tree: TokenTree, x: np.ndarray, kids: list[list[int]] | None = None) -> np.ndarray:
        """(n_nodes,) each node's score at its parent; 1 for the given nodes."""
        kids = kids if kids is not None else children_of(tree)
        out = np.ones(tree.n_nodes)
        for node, (_, q, n_kids, z) in lens_by_node(tree, kids, x, self.norm, self.eps, self.output).items():
            out[kids[node]] = scores(z, q, self.correction)[:n_kids]
        if not finite(out):  # (n_nodes,): a NaN score would sort last and be pruned as hopeless
            bad = int(np.flatnonzero(~np.isfinite(out))[0])
            where = f"the target's hidden state after layer {self.layer}" if not finite(x) else "the lens logits"
            raise NonFiniteError("pruning-predictor scores", role="target", layer=f"at tree node {bad}",
                                 cause=f"{where} holds NaN or Inf")
        return out

    def prune(self, tree: TokenTree, x: np.ndarray) -> np.ndarray:
        """(n_nodes,) bool: the nodes that go on past layer `layer`. x (n_nodes, n_embd) is the
        tree's hidden state after that layer. With a cost model, a pass where even pruning every
        branch off the backbone would save less than twice what scoring costs is not scored."""
        if tree.n_nodes <= tree.n_given:
            return np.ones(tree.n_nodes, bool)
        kids = children_of(tree)
        if self.cost is not None:
            n_backbone = len(backbone(tree, kids))
            most_s = self.cost.verify_s(tree.n_nodes) - self.cost.verify_s(tree.n_nodes, n_backbone, self.layer)
            if most_s < 2 * self.scoring_s:
                return np.ones(tree.n_nodes, bool)
        t0 = time.perf_counter()
        alive = prune_by_scores(tree, self.child_scores(tree, x, kids), self.threshold, self.max_prune_share,
                                self.cost, self.layer, kids)
        self.scoring_s = 0.8 * self.scoring_s + 0.2 * (time.perf_counter() - t0)
        self.n_scored += tree.n_nodes - tree.n_given
        self.n_pruned += int((~alive).sum())
        return alive


def prune_by_scores(tree: TokenTree, s: np.ndarray, threshold: float, max_share: float,
                    cost=None, layer: int = -1, kids: list[list[int]] | None = None) -> np.ndarray:
    """(n_nodes,) bool alive: children scored under the threshold go with their subtrees, the
    lowest first, never the backbone and never past max_share of the tree's nodes.

    With a cost model, a subtree goes only when it pays, by the rule TreeExpand grows trees
    with: the share of expected tokens it takes must be below the share of the cycle's time
    its pruning saves (the pass after `layer` on fewer tokens). So a pass that waits on flash
    prunes next to nothing, and a compute-bound one prunes all the hopeless branches."""
    alive = np.ones(tree.n_nodes, bool)
    kids = kids if kids is not None else children_of(tree)
    keep = backbone(tree, kids)
    cap = int(max_share * tree.n_nodes)
    reach = reach_probabilities(tree, s) if cost is not None else None
    expected = float(reach[tree.n_given:].sum()) + 1 if reach is not None else 0.0
    cycle_s = (tree.cycle_s or cost.verify_s(tree.n_nodes)) if cost is not None else 0.0
    pass_s = cost.verify_s(tree.n_nodes) if cost is not None else 0.0  # with what is pruned so far
    for node in np.argsort(s, kind="stable"):
        if s[node] >= threshold:
            break
        if node in keep or not alive[node]:
            continue
        sub = [i for i in subtree(kids, int(node)) if alive[i]]
        n_alive = int(alive.sum())
        if tree.n_nodes - n_alive + len(sub) > cap:
            continue
        if cost is not None:
            pruned_s = cost.verify_s(tree.n_nodes, n_alive - len(sub), layer)
            if reach[sub].sum() / expected > (pass_s - pruned_s) / cycle_s:
                continue
            pass_s = pruned_s
        alive[sub] = False
    return alive


def reach_probabilities(tree: TokenTree, s: np.ndarray) -> np.ndarray:
    """(n_nodes,) the chance the target's walk reaches each node, by the predictor's scores."""
    reach = np.ones(tree.n_nodes)
    for i in range(tree.n_given, tree.n_nodes):
        reach[i] = reach[tree.parents[i]] * s[i]
    return reach


def subtree(kids: list[list[int]], node: int) -> list[int]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(kids[n])
    return out


# -- the calibration artifact (written by `lever calibrate`)

ARTIFACT_VERSION = 1


def artifact_path(cfg_path: str, target: str | os.PathLike) -> Path:
    return Path(cfg_path).expanduser() if cfg_path else Path(str(target) + ARTIFACT_SUFFIX)


@attrs.frozen
class Artifact:
    """What `lever calibrate` fitted for one target model."""

    model: ModelIdentity  # size and first MiB, checked at every load
    model_sha256: str  # of the whole file, recorded for provenance
    layer: int
    threshold: float
    correction: Correction
    acceptance: AcceptanceTable = attrs.field(eq=False)  # draft p -> acceptance, for TreeExpand
    report: dict = attrs.field(factory=dict, eq=False)  # what calibration measured (held-out figures)
    source: str = attrs.field(default="", eq=False)  # the file it was read from, for errors naming it

    def write(self, path: Path) -> None:
        data = {"version": ARTIFACT_VERSION, "model": attrs.asdict(self.model), "model_sha256": self.model_sha256,
                "layer": self.layer, "threshold": self.threshold, "correction": attrs.asdict(self.correction),
                "calibration": {"accepted": self.acceptance.accepted.tolist(),
                                "trials": self.acceptance.trials.tolist(),
                                "prior_weight": self.acceptance.prior_weight},
                "report": self.report}
        with atomic_write(path, "wb", "predictor artifact") as f:  # whole or not at all, no temp left
            f.write(msgpack.packb(data))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Artifact:
        """The artifact at path, every field checked for type, shape and range (what needs no
        model: `read` adds the checks against the target), else one line naming the file and
        the field."""
        path = Path(path)
        data = read_msgpack(path, "predictor artifact", "run `lever calibrate -c CONFIG --corpus FILE`")
        f = Fields(path, "predictor artifact")
        if not isinstance(data, dict):
            raise LeverError(f"{path}: not a predictor artifact (a msgpack {type(data).__name__}, not a map)")
        version = f.key(data, "version", "")
        if type(version) is not int or version != ARTIFACT_VERSION:
            raise f.fail("version", f"predictor artifact version {shown(repr(version), 40)}, "
                                    f"expected {ARTIFACT_VERSION}")
        m = f.map(f.key(data, "model", ""), "model")
        model = ModelIdentity(f.string(f.key(m, "path", "model"), "model.path"),
                              f.integer(f.key(m, "size_bytes", "model"), "model.size_bytes"),
                              f.hex_digest(f.key(m, "sha256_first_mib", "model"), "model.sha256_first_mib"))
        sha = f.hex_digest(f.key(data, "model_sha256", ""), "model_sha256")
        layer = f.integer(f.key(data, "layer", ""), "layer", 0, MAX_LAYERS)
        threshold = f.number(f.key(data, "threshold", ""), "threshold", 0.0, 1.0)
        c = f.map(f.key(data, "correction", ""), "correction")
        # bounded so that a * z + b * log q stays finite for any lens logit a model makes
        corr = Correction(*(f.number(f.key(c, k, "correction"), f"correction.{k}", -1e6, 1e6)
                            for k in ("scale", "draft_weight", "none_logit")))
        report = f.map(data.get("report", {}), "report")  # what calibration measured: shown, never computed with
        return cls(model, sha, layer, threshold, corr, _acceptance(f, f.key(data, "calibration", "")), report,
                   source=str(path))

    @classmethod
    def read(cls, path: str | os.PathLike, target: str | os.PathLike, n_layer: int | None = None) -> Artifact:
        """The artifact at path (`load`), checked to belong to the target model file and, given
        the target's n_layer, to name one of its middle layers."""
        art = cls.load(path)
        if not art.model.same_file(ModelIdentity.of(target)):
            raise LeverError(f"{path}: calibrated for {shown(art.model.path)} (sha256 {art.model_sha256[:12]}), "
                             f"not {target}: run `lever calibrate` again")
        if n_layer is not None:
            art.check_layer(n_layer)
        return art

    def check_layer(self, n_layer: int) -> None:
        if not 0 <= self.layer < n_layer - 1:
            raise LeverError(f"{self.source or 'predictor artifact'}: layer: {self.layer} is not a middle layer "
                             f"of a {n_layer}-layer target (0..{n_layer - 2})")


MAX_LAYERS = 2**20
MAX_BINS = 2**16  # the acceptance table's probability bins (10 by default)


def _acceptance(f: Fields, cal) -> AcceptanceTable:
    """The calibration table: two rows (first children, the others) of n_bins cells, with
    0 <= accepted <= trials in each, and a positive prior (with none, an unobserved cell
    would estimate 0/0)."""
    cal = f.map(cal, "calibration")
    trials = f.array(f.key(cal, "trials", "calibration"), "calibration.trials", n=2)
    accepted = f.array(f.key(cal, "accepted", "calibration"), "calibration.accepted", n=2)
    n_bins = len(f.array(trials[0], "calibration.trials[0]", min_n=1, max_n=MAX_BINS))
    t = np.stack([f.numbers(r, f"calibration.trials[{i}]", n=n_bins, lo=0.0, hi=1e15) for i, r in enumerate(trials)])
    a = np.stack([f.numbers(r, f"calibration.accepted[{i}]", n=n_bins, lo=0.0, hi=1e15)
                  for i, r in enumerate(accepted)])
    over = np.argwhere(a > t)
    if over.size:
        r, b = over[0]
        raise f.fail(f"calibration.accepted[{r}][{b}]", f"= {a[r, b]:g} is more than its trials, {t[r, b]:g}")
    table = AcceptanceTable(n_bins=n_bins,
                            prior_weight=f.number(f.key(cal, "prior_weight", "calibration"), "calibration.prior_weight",
                                                  0.0, 1e9, above=0.0))
    table.accepted, table.trials = a, t
    return table


@attrs.frozen
class Pruning:
    """The predictor a run prunes with, settled before the target loads (lever.pipelines.plan):
    [predictor] with what it leaves to `lever calibrate`'s artifact filled in and checked."""

    layer: int
    threshold: float
    correction: Correction
    max_prune_share: float
    cost_aware: bool


def pruning_for(cfg: PredictorConfig, n_layer: int, artifact: Artifact | None = None) -> Pruning:
    """The configured pruning of an n_layer target; `artifact` (from `lever calibrate`) gives the
    correction, and the layer and threshold the config leaves to it."""
    layer, threshold, corr = cfg.layer, cfg.threshold, Correction()
    if artifact is not None:
        corr = artifact.correction
        layer = artifact.layer if layer < 0 else layer
        threshold = artifact.threshold if threshold < 0 else threshold
    if artifact is not None and cfg.layer < 0:
        artifact.check_layer(n_layer)  # the layer is the artifact's: name its file
    if not 0 <= layer < n_layer - 1:
        raise LeverError(f"[predictor] layer: {layer} is not a middle layer of a {n_layer}-layer target "
                         f"(0..{n_layer - 2})")
    return Pruning(layer, threshold, corr, cfg.max_prune_share, cfg.cost_aware)


def predictor_for(p: Pruning, model, cost=None) -> Predictor:
    """A run's predictor (its counters its own) over the target `model` (lever.model.transformer.Model)."""
    return Predictor(layer=p.layer, threshold=p.threshold, correction=p.correction, norm=model.output_norm,
                     eps=model.spec.rms_eps, output=model.output, max_prune_share=p.max_prune_share,
                     cost=cost if p.cost_aware else None)
