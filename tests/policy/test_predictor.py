"""The pruning predictor: candidates with shadows, scores, what may be pruned, the artifact."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from lever.dataflow.messages import Proposals, TokenTree
from lever.errors import LeverError
from lever.gguf.identity import ModelIdentity
from lever.policy.acceptance import AcceptanceTable
from lever.policy.predictor import (
    Artifact,
    Correction,
    backbone,
    candidates,
    children_of,
    prune_by_scores,
    scores,
    subtree,
)

#      0
#    1   2        the backbone is 0-1-3 (highest draft p at each step)
#   3 4   5
#   6
TREE = TokenTree(1, np.array([10, 11, 12, 13, 14, 15, 16]), np.array([-1, 0, 0, 1, 1, 2, 3], np.int32), 1,
                 np.array([1.0, 0.6, 0.3, 0.5, 0.05, 0.2, 0.4], np.float32),
                 drafts={0: Proposals(np.array([11, 12, 99]), np.array([0.6, 0.3, 0.05]))})


def test_candidates_put_children_first_then_the_drafts_other_proposals():
    toks, q, n_kids = candidates(TREE, children_of(TREE), 0)
    assert n_kids == 2 and toks.tolist() == [11, 12, 99]
    np.testing.assert_allclose(q, [0.6, 0.3, 0.05])


def test_a_lone_child_does_not_score_one_by_construction():
    toks, q, n_kids = candidates(TREE, children_of(TREE), 3)  # node 3 has one child, no proposals recorded
    assert n_kids == 1
    s = scores(np.array([0.0]), q, Correction(1.0, 0.0, 0.0))
    assert s[0] == pytest.approx(0.5)  # against "none of these"


def test_scores_follow_the_lens_and_sum_below_one():
    s = scores(np.array([3.0, 1.0, 0.0]), np.array([0.2, 0.2, 0.2]), Correction(1.0, 0.0, -5.0))
    assert s[0] > s[1] > s[2] and s.sum() < 1.0


def test_the_backbone_is_never_pruned_and_subtrees_go_together():
    s = np.zeros(TREE.n_nodes)  # every child hopeless
    alive = prune_by_scores(TREE, s, threshold=0.5, max_share=1.0)
    assert set(np.flatnonzero(alive)) == backbone(TREE, children_of(TREE)) == {0, 1, 3, 6}
    assert not alive[2] and not alive[5]  # 5 went with its parent 2


def test_the_cap_limits_the_share_pruned():
    s = np.zeros(TREE.n_nodes)
    alive = prune_by_scores(TREE, s, threshold=0.5, max_share=2 / 7)
    assert (~alive).sum() <= 2
    assert (~alive).sum() > 0


def test_nothing_is_pruned_above_the_threshold():
    assert prune_by_scores(TREE, np.full(TREE.n_nodes, 0.9), threshold=0.5, max_share=1.0).all()


def test_subtree():
    assert sorted(subtree(children_of(TREE), 1)) == [1, 3, 4, 6]


def test_artifact_round_trip_and_model_check(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(5000))
    cal = AcceptanceTable()
    cal.observe(0.9, 0, True)
    art = Artifact(ModelIdentity.of(model), "ab" * 32, 3, 0.1, Correction(2.0, 0.5, -1.0), cal, {"x": 1})
    path = tmp_path / "p.msgpack"
    art.write(path)
    back = Artifact.read(path, model)
    assert (back.layer, back.threshold, back.correction) == (3, 0.1, Correction(2.0, 0.5, -1.0))
    assert back.acceptance(0.95, 0) == cal(0.95, 0)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(4999) + b"x")
    with pytest.raises(LeverError, match="calibrated for .*m.gguf"):
        Artifact.read(path, other)


def test_a_missing_or_corrupt_artifact_is_one_line(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(LeverError, match="no such predictor artifact.*lever calibrate"):
        Artifact.read(tmp_path / "nope.msgpack", model)
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\xc1garbage")
    with pytest.raises(LeverError, match="bad.msgpack"):
        Artifact.read(bad, model)


class FakeCost:
    """A pass of n nodes, n_after of them past the predictor's layer: fixed read time plus a
    per-token compute that only counts when compute_bound."""

    def __init__(self, compute_bound: bool):
        self.per_token_s = 0.01 if compute_bound else 0.0

    def verify_s(self, n, n_after=None, layer=-1):
        return 0.5 + self.per_token_s * (n if n_after is None else n_after)


def test_cost_aware_pruning_prunes_only_what_pays():
    s = np.array([1.0, 0.9, 0.05, 0.9, 0.5, 0.04, 0.9])  # 2 (and 5 under it) are hopeless
    waiting_on_flash = prune_by_scores(TREE, s, 0.3, 1.0, FakeCost(compute_bound=False))
    compute_bound = prune_by_scores(TREE, s, 0.3, 1.0, FakeCost(compute_bound=True))
    assert waiting_on_flash.all()  # saving compute nobody waits for is not worth a token
    assert not compute_bound[2] and not compute_bound[5] and compute_bound[[0, 1, 3, 4, 6]].all()


def test_batched_scoring_equals_the_lens_node_by_node():
    """child_scores gathers every candidate row once; the calibration records node by node."""
    from pathlib import Path

    from lever.model.transformer import Model
    from lever.policy.predictor import Predictor, lens_logits

    m = Model(Path(__file__).resolve().parents[2] / "examples" / "models" / "stdlib-target-q4_0.gguf",
              load_layers=False)
    tree = attrs.evolve(TREE, tokens=TREE.tokens + 100, drafts={0: Proposals(np.array([111, 112, 199]),
                                                                          np.array([0.6, 0.3, 0.05]))})
    x = np.random.default_rng(0).normal(size=(tree.n_nodes, m.spec.n_embd)).astype(np.float32)
    corr = Correction(0.7, 0.9, -1.0)
    p = Predictor(3, 0.1, corr, m.output_norm, m.spec.rms_eps, m.output)
    got = p.child_scores(tree, x)
    kids = children_of(tree)
    for node in range(tree.n_nodes):
        if kids[node]:
            toks, q, n_kids = candidates(tree, kids, node)
            want = scores(lens_logits(x[node], toks, m.output_norm, m.spec.rms_eps, m.output), q, corr)[:n_kids]
            np.testing.assert_allclose(got[kids[node]], want, rtol=1e-5, atol=1e-7)
