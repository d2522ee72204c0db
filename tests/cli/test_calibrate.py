"""`lever calibrate` end to end on the shipped pair: it records real trees, fits, writes an
artifact that loads only for its model, and pruning with it keeps the target's tokens."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from lever.cli.calibrate import calibrate
from lever.cli.main import main
from lever.config import load_config
from lever.errors import LeverError
from lever.pipelines.engine import run_pipeline
from lever.policy.fit import Recorder, fit_correction, on_target_path
from lever.shipped import shipped

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "default.toml"
CORPUS = Path(argparse.__file__)  # Python code the pair was not trained on? It was: the stdlib. Real code all the same


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "pred.msgpack"
    cfg = load_config(CONFIG, ["tree_expand.max_nodes=32"])
    art, path = calibrate(cfg, CORPUS, out, n_prompts=6, n_gen=24)
    assert path == out and out.exists()
    return art, out


def test_calibration_fits_a_layer_a_threshold_and_reports_depths(artifact):
    art, _ = artifact
    assert 0 <= art.layer < 5 and 0.0 <= art.threshold < 1.0
    r = art.report
    assert r["fit_trees"] > 10 and r["held_out_trees"] > 3
    assert r["depth"] and r["depth"][0]["depth"] == 1
    assert all(0.0 <= d["predicted"] <= 1.0 and 0.0 <= d["observed"] <= 1.0 for d in r["depth"])
    assert r["tokens_per_pass_pruned"] <= r["tokens_per_pass"] + 1e-9  # pruning never adds tokens
    assert len(art.model_sha256) == 64


def test_the_artifact_prunes_losslessly(artifact):
    _, path = artifact
    sets = [f'predictor.artifact="{path}"', "predictor.enabled=true", "predictor.threshold=0.3",
            'tree_expand.acceptance="calibrated"', "generate.n_predict=40"]
    pruned = run_pipeline(load_config(CONFIG, sets), "def parse_args(argv):\n")
    plain = run_pipeline(load_config(CONFIG, ["generate.n_predict=40"]), "def parse_args(argv):\n")
    assert pruned.tokens == plain.tokens


def test_an_artifact_of_another_model_is_refused(artifact):
    _, path = artifact
    cfg = load_config(CONFIG, [f'predictor.artifact="{path}"', "predictor.enabled=true",
                               f'model.target="{shipped("models", "stdlib-draft-q8_0.gguf")}"'])
    with pytest.raises(LeverError, match="calibrated for .*stdlib-target"):
        run_pipeline(cfg, "x = 1\n")


def test_the_fit_recovers_a_known_correction():
    rng = np.random.default_rng(0)
    true_a, true_b, true_c = 0.7, 0.4, -0.5
    data = []
    for _ in range(3000):
        z, q = rng.normal(0, 3, 4), rng.dirichlet(np.ones(4))
        logit = np.append(true_a * z + true_b * np.log(q), true_c)
        p = np.exp(logit - logit.max())
        y = rng.choice(5, p=p / p.sum())
        data.append((z, q, -1 if y == 4 else int(y)))
    c = fit_correction(data)
    assert (c.scale, c.draft_weight, c.none_logit) == pytest.approx((true_a, true_b, true_c), abs=0.1)


def test_recorder_labels_are_the_targets_tokens():
    from lever.model.transformer import Model
    model = Model(ROOT / "examples" / "models" / "stdlib-target-q4_0.gguf", load_layers=False)
    rec = Recorder(model, (2,))
    run_pipeline(load_config(CONFIG, ["generate.n_predict=24"]), "import os\n", observer=rec)
    assert rec.trees, "the observer saw no tree"
    for t in rec.trees:
        reached = on_target_path(t)
        assert reached[0] and reached.sum() >= 1
        assert all(2 in t.lens and n in t.lens[2] for n in range(t.tree.n_nodes) if (t.tree.parents == n).any())


def test_cli_calibrate_on_a_bad_corpus_is_one_line(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("x")
    assert main(["calibrate", "-c", str(CONFIG), "--corpus", str(short)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "short.txt" in err
