"""The pair shipped in examples/models/, loaded with Lever alone (no torch): one tokenizer, a draft
at least 8x smaller, a target that completes Python, a draft that agrees with it; and a smoke run
of examples/train_pair.py when torch (the `train` extra) is installed."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from lever.gguf.file import GGUFFile
from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import generate
from lever.model.transformer import Model
from tests.conftest import ROOT

MODELS = ROOT / "examples" / "models"
TARGET = MODELS / "stdlib-target-q4_0.gguf"
DRAFT = MODELS / "stdlib-draft-q8_0.gguf"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pair():
    return Model(TARGET), Model(DRAFT)


def _n_params(path) -> int:
    return sum(int(np.prod(t.shape)) for t in GGUFFile(path).tensors.values())


def test_pair_shares_one_tokenizer(pair):
    target, draft = pair
    tt, td = Tokenizer.from_gguf(target.file), Tokenizer.from_gguf(draft.file)
    assert tt._vocab.tokens == td._vocab.tokens and tt._vocab.merges == td._vocab.merges
    assert (tt.bos_id, tt.eos_ids, tt.add_bos) == (td.bos_id, td.eos_ids, td.add_bos)
    assert target.spec.n_vocab == draft.spec.n_vocab == tt.vocab_size
    text = "def f(x):\n    return {'a': x ** 2}  # ok\n"
    assert tt.encode(text) == td.encode(text) and tt.decode(tt.encode(text)) == text


def test_draft_is_at_least_8x_smaller():
    assert _n_params(TARGET) >= 8 * _n_params(DRAFT)
    assert 10e6 <= _n_params(TARGET) <= 30e6


def test_target_greedy_completion_is_python(pair):
    target, _ = pair
    tok = Tokenizer.from_gguf(target.file)
    prompt = "import os\n\n\ndef read_lines(path):\n"
    res = generate(target, tok.encode(prompt), 40, eos_ids=frozenset(tok.eos_ids))
    text = tok.decode(res.tokens)
    assert text.startswith("    "), text  # the body is indented
    assert any(w in text for w in ("return", "with ", "open(", "for ", "if ")), text
    # a complete statement or two parse: cut at the last full line, dedent the body
    lines = (prompt + text).splitlines()[:-1]
    try:
        ast.parse("\n".join(lines) + "\n        pass\n")
    except SyntaxError:
        ast.parse("\n".join(lines) + "\n    pass\n")


def test_draft_agrees_with_target_on_held_out_code(pair):
    ev = _example("eval_pair")
    target, draft = pair
    tok = Tokenizer.from_gguf(target.file)
    ids = ev.held_out_tokens(tok, 512)  # files the pair never saw in training
    assert ids.size == 512
    res = ev.evaluate_pair(target, draft, ids)
    assert res["agreement"] > 0.5, res
    assert res["target_loss"] < res["draft_loss"], res


def test_lever_never_imports_torch():
    code = ("import sys, lever.cli.main, lever.model.transformer, lever.model.generate, lever.gguf.tokenizer, "
            "lever.pipelines.engine, lever.cli.bench.model\n"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_train_pair_smoke_run(tmp_path):
    pytest.importorskip("torch", reason="torch is the `train` extra (pip install -e '.[train]'), not in the test extra")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_pair.py"), "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Lever's tokenizer gives the same ids" in proc.stdout
    log = json.loads((tmp_path / "train_log.json").read_text())
    t, d = Model(tmp_path / log["target"]["path"]), Model(tmp_path / log["draft"]["path"])
    assert t.spec.n_vocab == d.spec.n_vocab
    assert log["target"]["history"][-1]["train_loss"] < log["target"]["history"][0]["train_loss"]
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_pair.py"), "--tiny", "--out", str(again)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in (log["target"]["path"], log["draft"]["path"]):  # deterministic given the seed: the same bytes
        assert (again / name).read_bytes() == (tmp_path / name).read_bytes(), name
