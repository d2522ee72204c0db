"""Non-finite numbers presented as output: a model whose weights hold NaN or
Inf ends every command with one line naming the file, which model (target or draft), the
position and the layer or tensor at fault, never with tokens read off NaN logits. The faulty
files are copies of the shipped pair with one tensor poisoned; the plain functions are tested
too, without an event loop."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from lever.backends.cpu.kv_cache import causal_mask
from lever.dataflow.messages import Proposals, TokenTree
from lever.errors import LeverError
from lever.fuzz.inputs import RandomChooser
from lever.fuzz.models import nonfinite_model
from lever.gguf.file import GGUFFile
from lever.model.finite import NonFiniteError, check_small_tensors, finite, scan, scan_tensor
from lever.model.generate import generate
from lever.model.sampling import SamplingParams, distribution
from lever.model.transformer import Model
from lever.policy.predictor import Correction, Predictor
from lever.shipped import shipped
from lever.stages.draft import softmax_top_k
from tests.cli.test_main import assert_one_line_error
from tests.conftest import ROOT

TARGET = shipped("models", "stdlib-target-q4_0.gguf")
DRAFT = shipped("models", "stdlib-draft-q8_0.gguf")
HALF = {"nan": 0x7E00, "inf": 0x7C00}


def poison(src, dst, name: str, value: str = "nan"):
    """A copy of src with tensor `name` poisoned: every value of an F32 tensor, or the float16
    scale of the first block of a block-quantized one (so that block's 32 values)."""
    shutil.copy(src, dst)
    info = GGUFFile(dst).tensor(name)
    with open(dst, "r+b") as f:
        f.seek(info.offset)
        if info.type.name == "F32":
            f.write(np.full(info.shape, float(value), np.float32).tobytes())
        else:
            f.write(np.uint16(HALF[value]).tobytes())
    return dst


def lever(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lever", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    d = tmp_path_factory.mktemp("nonfinite")
    return {
        "target_norm": poison(TARGET, d / "target-norm-nan.gguf", "output_norm.weight"),
        "draft_norm": poison(DRAFT, d / "draft-norm-nan.gguf", "output_norm.weight"),
        "target_layer": poison(TARGET, d / "target-layer-inf.gguf", "blk.1.ffn_down.weight", "inf"),
        "draft_layer": poison(DRAFT, d / "draft-layer-inf.gguf", "blk.1.ffn_down.weight", "inf"),
        "draft_head": poison(DRAFT, d / "draft-head-nan.gguf", "output.weight" if "output.weight" in
                             GGUFFile(DRAFT).tensors else "token_embd.weight"),
    }


# -- lever run: the instance, as target and as draft


def test_a_nan_output_norm_as_the_target_is_refused_in_one_line(faulty):
    p = lever("run", "-n", "4", "--set", f'model.target="{faulty["target_norm"]}"')
    assert_one_line_error(p, str(faulty["target_norm"]), "output_norm.weight", "NaN")
    assert "stop: eos" not in p.stdout


def test_the_same_file_as_the_draft_is_refused_in_one_line(faulty):
    p = lever("run", "-n", "4", "--set", f'model.draft="{faulty["draft_norm"]}"')
    assert_one_line_error(p, str(faulty["draft_norm"]), "output_norm.weight", "NaN")


def test_inf_in_a_streamed_target_layer_names_the_model_the_position_and_the_tensor(faulty):
    p = lever("run", "-n", "4", "--set", f'model.target="{faulty["target_layer"]}"')
    assert_one_line_error(p, "target model", str(faulty["target_layer"]), "at position", "blk.1.ffn_down.weight")


def test_inf_in_a_draft_layer_names_the_first_layer_whose_output_went_non_finite(faulty):
    p = lever("run", "-n", "4", "--set", f'model.draft="{faulty["draft_layer"]}"')
    assert_one_line_error(p, "draft model", str(faulty["draft_layer"]), "at position 0", "output of layer 1",
                          "blk.1.ffn_down.weight")


# -- the other commands


def test_generate_the_dram_loop_refuses_in_one_line(faulty):
    p = lever("generate", "-m", str(faulty["draft_layer"]), "-p", "def f(x):", "-n", "4")
    assert_one_line_error(p, str(faulty["draft_layer"]), "at position 0", "layer 1")


def test_logits_are_not_saved_when_non_finite(faulty, tmp_path):
    out = tmp_path / "l.npy"
    p = lever("logits", "-m", str(faulty["draft_head"]), "--tokens", "1,2,3", "--out", str(out))
    assert_one_line_error(p, str(faulty["draft_head"]), "non-finite logits", "at position 0", "output head")
    assert not out.exists()


def test_inspect_check_passes_a_clean_model_and_lists_a_faulty_ones_tensors(faulty):
    ok = lever("inspect", "--check", str(TARGET))
    assert ok.returncode == 0, ok.stderr
    assert "0 holding NaN or Inf" in ok.stdout
    bad = lever("inspect", "--check", str(faulty["target_layer"]))
    assert_one_line_error(bad, str(faulty["target_layer"]), "1 of")
    assert "blk.1.ffn_down.weight: 1 NaN, 31 Inf" in bad.stdout


# -- the plain functions, no event loop


def test_load_refuses_a_nan_norm_and_the_scan_counts_it(faulty):
    f = GGUFFile(faulty["target_norm"])
    assert scan_tensor(f, "output_norm.weight") == (384, 0)
    assert [n for n, *_ in scan(f)] == ["output_norm.weight"]
    with pytest.raises(NonFiniteError, match="output_norm.weight holds 384 NaN"):
        check_small_tensors(f)
    with pytest.raises(LeverError, match="output_norm.weight"):
        Model(faulty["target_norm"])
    check_small_tensors(GGUFFile(TARGET))  # the clean file passes


def test_a_forward_names_the_layer_and_generate_raises_before_any_token(faulty):
    m = Model(faulty["draft_layer"])
    with pytest.raises(NonFiniteError) as e:
        m.forward(np.array([1, 2, 3]), np.arange(3, dtype=np.int32), causal_mask(0, 3), m.new_cache(4))
    assert e.value.position == 0 and "layer 1" in e.value.layer and "blk.1.ffn_down.weight" in e.value.cause
    got = []
    with pytest.raises(NonFiniteError):
        generate(m, [1, 2, 3], 4, on_token=got.append)
    assert got == []


def test_non_finite_head_weights_are_caught_on_the_logits(faulty):
    m = Model(faulty["draft_head"])
    h = m.forward(np.array([1, 2]), np.arange(2, dtype=np.int32), causal_mask(0, 2), m.new_cache(2))
    logits = m.logits(h)
    with pytest.raises(NonFiniteError, match="from the output head") as e:
        m.check_logits(logits, [7, 8], role="draft")
    assert str(e.value).startswith(f"draft model {faulty['draft_head']}: non-finite logits")
    with pytest.raises(NonFiniteError):
        softmax_top_k(logits, 4)


def test_the_checks_are_one_reduction_and_catch_every_kind():
    x = np.zeros((3, 50), np.float32)
    assert finite(x) and finite(np.zeros(0))
    for v in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, 7] = v
        assert not finite(y)


def test_sampling_refuses_nan_logits_and_a_tiny_temperature_draws_the_likeliest():
    with pytest.raises(NonFiniteError):
        distribution(np.array([0.0, np.nan, 1.0]), SamplingParams(temperature=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning printed beside the output
        p = distribution(np.array([1.0, 3.0, 3.0, -2.0], np.float32), SamplingParams(temperature=1e-308))
        assert np.array_equal(p, [0.0, 0.5, 0.5, 0.0])
        q = distribution(np.array([0.0, -5.0], np.float32), SamplingParams(temperature=1e-308))
        assert np.array_equal(q, [1.0, 0.0])
    same = distribution(np.array([0.5, 1.0, 2.0]), SamplingParams(temperature=0.7))  # numerics untouched:
    z = np.array([0.5, 1.0, 2.0], np.float32) / np.float32(0.7)  # llama.cpp's, in float32
    w = np.exp(z - z.max(), dtype=np.float32).astype(np.float64)
    assert np.array_equal(same, w / w.sum())


def test_predictor_scores_from_a_nan_hidden_state_are_refused():
    m = Model(DRAFT)
    tree = TokenTree(1, np.array([5, 6, 7]), np.array([-1, 0, 0], np.int32), 1,
                     drafts={0: Proposals(np.array([6, 7]), np.array([0.6, 0.3], np.float32))})
    pred = Predictor(2, 0.1, Correction(), m.output_norm, m.spec.rms_eps, m.output)
    x = np.zeros((3, m.spec.n_embd), np.float32)
    x[1] = 0.5
    pred.child_scores(tree, x)  # finite: scored
    x[0, 3] = np.nan
    with pytest.raises(NonFiniteError, match="after layer 2"):
        pred.child_scores(tree, x)


def test_fuzzed_non_finite_models_are_scanned_exactly_and_never_run_silently(tmp_path):
    outcomes = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as the fuzzer runs: a warning means a value went unchecked
        for seed in range(40):
            blob, name = nonfinite_model(RandomChooser(random.Random(seed)))
            path = tmp_path / f"m{seed}.gguf"
            blob.write(path)
            f = GGUFFile(path)
            assert [n for n, *_ in scan(f)] == [name]
            try:
                m = Model(file=f)
                n = min(2, m.spec.n_ctx_train)
                h = m.forward(np.array([0, m.spec.n_vocab - 1][:n]), np.arange(n, dtype=np.int32), causal_mask(0, n),
                              m.new_cache(n))
                m.check_logits(m.logits(h))
                outcomes.add("finite")
            except LeverError as e:
                assert str(path) in str(e) and "\n" not in str(e)
                outcomes.add("refused")
    assert "refused" in outcomes
