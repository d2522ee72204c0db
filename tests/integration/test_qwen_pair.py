"""The real Qwen2.5-Coder pair (fetched by ../shared/tools/fetch-qwen-pair): sensible code, and
teacher-forced next-token argmax agreeing with independent engines on >= 99% of positions.

References: the numpy float64 forward (lever.reference.forward, gguf-py dequantization, no
native code) always; llama.cpp through llama-cpp-python when it is importable.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from lever.generate import generate
from lever.kv_cache import causal_mask
from lever.model import Model
from lever.reference.forward import ReferenceModel
from lever.tokenizer import Tokenizer

AGREEMENT_MIN = 0.99
N_POSITIONS = 96  # teacher-forced positions per model: enough for a 1% resolution


def code_tokens(tok: Tokenizer) -> list[int]:
    text = inspect.getsource(json.JSONEncoder.iterencode)  # real Python, same on every machine
    return tok.encode(text)[:N_POSITIONS]


def native_argmax(model: Model, ids: list[int]) -> np.ndarray:
    n = len(ids)
    h = model.forward(np.array(ids), np.arange(n, dtype=np.int32), causal_mask(0, n), model.new_cache(n))
    return model.logits(h).argmax(-1)


@pytest.fixture(params=["target", "draft"])
def qwen(request, qwen_target, qwen_draft):
    return qwen_target if request.param == "target" else qwen_draft


def test_generates_sensible_code(qwen):
    model, tok = Model(qwen), Tokenizer.from_gguf(qwen)
    prompt = "def quicksort(arr):\n"
    res = generate(model, tok.encode(prompt), n_predict=64, eos_ids=frozenset(tok.eos_ids))
    text = tok.decode(res.tokens)
    print(prompt + text)
    assert "return" in text and "arr" in text and "pivot" in text, text


def test_teacher_forced_argmax_agrees_with_numpy_reference(qwen):
    tok = Tokenizer.from_gguf(qwen)
    ids = code_tokens(tok)
    ours = native_argmax(Model(qwen), ids)
    ref = ReferenceModel(qwen).logits(ids).argmax(-1)
    agreement = float(np.mean(ours == ref))
    print(f"{qwen.name}: agreement with numpy reference {agreement:.4f} over {len(ids)} positions")
    assert agreement >= AGREEMENT_MIN


def test_teacher_forced_argmax_agrees_with_llama_cpp(qwen, llama_cpp):
    tok = Tokenizer.from_gguf(qwen)
    ids = code_tokens(tok)
    llm = llama_cpp.Llama(model_path=str(qwen), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    ref = np.asarray(llm.scores[: len(ids)]).argmax(-1)
    ours = native_argmax(Model(qwen), ids)
    agreement = float(np.mean(ours == ref))
    print(f"{qwen.name}: agreement with llama.cpp {agreement:.4f} over {len(ids)} positions")
    assert agreement >= AGREEMENT_MIN
