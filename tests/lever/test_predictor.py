"""The pruning predictor: candidates with shadows, scores, what may be pruned, the artifact."""

from __future__ import annotations

import numpy as np
import pytest

from lever.calibration import Calibration
from lever.errors import LeverError
from lever.messages import TokenTree
from lever.predictor import (Artifact, Correction, backbone, candidates, children_of, prune_by_scores, scores,
                             subtree)
from lever.profile import ModelIdentity

#      0
#    1   2        the backbone is 0-1-3 (highest draft p at each step)
#   3 4   5
#   6
TREE = TokenTree(1, np.array([10, 11, 12, 13, 14, 15, 16]), np.array([-1, 0, 0, 1, 1, 2, 3], np.int32), 1,
                 np.array([1.0, 0.6, 0.3, 0.5, 0.05, 0.2, 0.4], np.float32),
                 drafts={0: (np.array([11, 12, 99]), None, np.array([0.6, 0.3, 0.05]))})


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
    cal = Calibration()
    cal.observe(0.9, 0, True)
    art = Artifact(ModelIdentity.of(model), "ab" * 32, 3, 0.1, Correction(2.0, 0.5, -1.0), cal, {"x": 1})
    path = tmp_path / "p.msgpack"
    art.write(path)
    back = Artifact.read(path, model)
    assert (back.layer, back.threshold, back.correction) == (3, 0.1, Correction(2.0, 0.5, -1.0))
    assert back.calibration(0.95, 0) == cal(0.95, 0)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(4999) + b"x")
    with pytest.raises(LeverError, match="calibrated for .*m.gguf"):
        Artifact.read(path, other)


def test_a_missing_or_corrupt_artifact_is_one_line(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(LeverError, match="no predictor artifact.*lever calibrate"):
        Artifact.read(tmp_path / "nope.msgpack", model)
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\xc1garbage")
    with pytest.raises(LeverError, match="bad.msgpack"):
        Artifact.read(bad, model)
