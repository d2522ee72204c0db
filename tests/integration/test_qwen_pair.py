"""The real Qwen2.5-Coder pair (fetched by `lever pull qwen2.5-coder`): sensible code, and
teacher-forced next-token argmax agreeing with independent engines.

Two quantized engines never agree on every position: 8-bit activations turn the tiniest
difference in float summation order into a different rounding somewhere, and over 28 layers
that shifts logits by about 3% (llama.cpp batched vs llama.cpp token-by-token differ that much,
and their argmax agree on only ~98.6% of positions). So agreement is asserted where the
reference is itself stable: at >= 99% of the positions where llama.cpp's own batched and
token-by-token runs agree (or where the float64 reference's top-2 margin exceeds the noise),
and overall at no less than the reference's agreement with itself.
"""

from __future__ import annotations

import pathlib
import sysconfig

import numpy as np
import pytest

from lever.backends.cpu.kv_cache import causal_mask
from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import generate
from lever.model.reference.forward import ReferenceModel
from lever.model.transformer import Model

AGREEMENT_MIN = 0.99  # on the positions where the reference's answer is stable
SELF_AGREEMENT_SLACK = 0.005  # overall, we may trail the reference's self-agreement by this
N_POSITIONS = 256
# The float64 reference keeps activations exact; quantized engines (ours, llama.cpp) differ
# from it by ~6% in logits (llama.cpp measured at 5.8% on the 1.5B). A top-2 margin above
# this many logits is beyond that noise.
STABLE_MARGIN = 1.0
LOGIT_RTOL_VS_FLOAT64 = 0.08


def code_tokens(tok: Tokenizer) -> list[int]:
    text = pathlib.Path(sysconfig.get_paths()["stdlib"], "json", "encoder.py").read_text()  # real Python
    return tok.encode(text)[:N_POSITIONS]


def native_logits(model: Model, ids: list[int]) -> np.ndarray:
    n = len(ids)
    h = model.forward(np.array(ids), np.arange(n, dtype=np.int32), causal_mask(0, n), model.new_cache(n))
    return model.logits(h)


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
    compile(prompt + text.rsplit("\n", 1)[0], "<completion>", "exec")  # complete lines parse as Python


def test_teacher_forced_argmax_agrees_with_float64_reference(qwen):
    tok = Tokenizer.from_gguf(qwen)
    ids = code_tokens(tok)
    ours = native_logits(Model(qwen), ids)
    ref = ReferenceModel(qwen).logits(ids)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    stable = top2[:, 1] - top2[:, 0] > STABLE_MARGIN
    same = ours.argmax(-1) == ref.argmax(-1)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    print(f"{qwen.name}: vs float64 reference: agreement {same.mean():.4f} overall, {same[stable].mean():.4f} on "
          f"{stable.sum()} stable positions of {len(ids)}; relative logit error {rel:.4f}")
    assert rel < LOGIT_RTOL_VS_FLOAT64
    assert same[stable].mean() >= AGREEMENT_MIN


def test_teacher_forced_argmax_agrees_with_llama_cpp(qwen, llama_cpp):
    tok = Tokenizer.from_gguf(qwen)
    ids = code_tokens(tok)

    def llama_logits(n_ubatch: int) -> np.ndarray:
        llm = llama_cpp.Llama(model_path=str(qwen), n_ctx=512, n_batch=n_ubatch, n_ubatch=n_ubatch,
                              logits_all=True, verbose=False, n_threads=2)
        llm.eval(ids)
        out = np.asarray(llm.scores[: len(ids)]).copy()
        llm.close()
        return out.argmax(-1)

    batched, stepped = llama_logits(N_POSITIONS), llama_logits(1)
    ours = native_logits(Model(qwen), ids).argmax(-1)
    stable = batched == stepped
    same = ours == batched
    print(f"{qwen.name}: llama.cpp agrees with itself (batched vs token-by-token) on {stable.mean():.4f}; "
          f"ours agrees with llama.cpp on {same.mean():.4f} overall, {same[stable].mean():.4f} where it is stable")
    assert same[stable].mean() >= AGREEMENT_MIN
    assert same.mean() >= stable.mean() - SELF_AGREEMENT_SLACK
