"""Placement: stages on the QNN HTP backend (the simulator here) or the CPU, from the config;
within one placement, speculative output is that placement's own autoregressive output.

A session with a soc_model turns every later float32 session of the process into float16
(lever.backends.qnn.runner._note_soc_model), so the runs that open one run in a process of their
own: the float32 parity tests of tests/backends/qnn hold in whatever order the tests run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import lever.backends.qnn as qnn
from lever.config import load_config
from lever.errors import LeverError
from lever.pipelines.engine import run_pipeline

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "default.toml"
ON_QNN = ['placement.verify="qnn"', 'placement.draft_batch="qnn"']
PROMPT = "def read_config(path):\n"

requires_qnn = pytest.mark.skipif(not qnn.is_available(), reason=f"QNN unavailable: {qnn.unavailable_reason()}")


RUN = """
import json, sys
from lever.config import load_config
from lever.pipelines.engine import run_pipeline
res = run_pipeline(load_config(sys.argv[1], json.loads(sys.argv[2])), sys.argv[3])
print("RESULT " + json.dumps({"tokens": list(res.tokens), "placement": res.placement,
                              "tokens_per_pass": res.output.tokens_per_pass}))
"""


def run_apart(config: Path, sets: list[str]) -> dict:
    """run_pipeline in a process of its own: its tokens, placement and tokens per pass."""
    p = subprocess.run([sys.executable, "-c", RUN, str(config), json.dumps(sets), PROMPT], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.split("RESULT ", 1)[1])


@requires_qnn
def test_speculative_on_the_npu_equals_autoregressive_on_the_npu():
    sets = [*ON_QNN, "generate.n_predict=24", 'pipeline.baseline=""', "tree_expand.max_nodes=16"]
    spec = run_apart(DEFAULT, sets)
    ar = run_apart(DEFAULT, [*sets, 'pipeline.kind="flash-ar"'])
    assert spec["tokens"] == ar["tokens"]
    assert spec["tokens_per_pass"] > 1.0
    assert spec["placement"]["verify"].startswith("qnn") and spec["placement"]["draft_single"] == "cpu"
    assert spec["placement"]["lm_head"].startswith("cpu")


@requires_qnn
@pytest.mark.parametrize("name", ["snapdragon-8gen3", "snapdragon-8elite", "x86-dev", "cpu-only"])
def test_every_example_placement_runs(name):
    res = run_apart(ROOT / "examples" / f"{name}.toml", ["generate.n_predict=8"])
    assert len(res["tokens"]) == 8
    on_npu = name.startswith("snapdragon")
    assert res["placement"]["verify"].startswith("qnn") == on_npu
    assert any(k.startswith("qnn ") for k in res["placement"]) == on_npu  # the runner's padding and session figures


def test_without_qnn_a_config_that_asks_for_it_fails_in_one_line_or_falls_back(monkeypatch):
    monkeypatch.setattr(qnn, "is_available", lambda: False)
    monkeypatch.setattr(qnn, "unavailable_reason", lambda: "no HTP here")
    with pytest.raises(LeverError, match=r"\[placement\] verify = \"qnn\".*no HTP here.*fallback"):
        run_pipeline(load_config(DEFAULT, [*ON_QNN, "generate.n_predict=4", 'pipeline.baseline=""']), PROMPT)
    res = run_pipeline(load_config(DEFAULT, [*ON_QNN, 'placement.fallback="cpu"', "generate.n_predict=4",
                                             'pipeline.baseline=""']), PROMPT)
    assert res.placement["verify"] == "cpu (fallback: no HTP here)"


@pytest.mark.parametrize("sets,match", [
    (['placement.verify="gpu"'], r"\[placement\] verify: unknown backend 'gpu'"),
    (['placement.draft_single="qnn"'], r"\[placement\] draft_single: one-token drafting"),
    (['qnn.precision="int4"'], r"\[qnn\] precision"),
    (["placement.nope=1"], r"\[placement\] unknown key 'nope'"),
])
def test_bad_placement_keys_are_one_line(sets, match):
    with pytest.raises(LeverError, match=match):
        load_config(DEFAULT, sets)
