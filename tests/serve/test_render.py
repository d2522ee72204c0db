"""What a finished generation looks like on the wire (lever.serve.render): OpenAI's logprobs per
endpoint, streamed too, equal to the Python API's (the target's own); llama.cpp's timings in
every response, finite and adding up to the run's figures."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from lever.dataflow.messages import TokenLogprob
from lever.serve.render import chat_logprobs, completion_logprobs, timings

PROMPT = "def parse_args(argv):"
MESSAGES = [{"role": "user", "content": "import os"}]


def test_completion_logprobs_are_the_apis(client, llm):
    want = llm.generate(PROMPT, max_tokens=12, logprobs=3)
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [x.logprob for x in want.logprobs]
    assert "".join(lp.tokens) == want.text  # these tokens are whole characters
    assert [list(d) for d in lp.top_logprobs] == [[llm.tokenizer.token_bytes(t).decode() for t, _ in x.top]
                                                  for x in want.logprobs]
    assert lp.text_offset == [len(llm.tokenizer.decode(want.tokens[:i])) for i in range(len(want.tokens))]


def test_chat_logprobs_streamed_add_up_to_the_whole(client, llm):
    want = llm.chat(MESSAGES, max_tokens=16, logprobs=2)
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    eos = set(llm.tokenizer.eos_ids)
    shown = [x for x in want.logprobs if x.token not in eos]
    assert [c.logprob for c in content] == [x.logprob for x in shown]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode() == want.text
    streamed = []
    for chunk in client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, logprobs=True,
                                                top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    plain = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16)
    assert plain.choices[0].logprobs is None  # not asked for


def test_every_response_carries_timings_with_llama_cpps_names(server, llm):
    url = server[1]
    body = {"prompt": PROMPT, "max_tokens": 20}
    t = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["timings"]
    # prompt_n: the tokens prefilled; cache_n: those a kept conversation held already (an earlier chat's BOS)
    assert t["prompt_n"] + t["cache_n"] == len(llm.tokenizer.encode(PROMPT)) and t["predicted_n"] == 20
    assert t["draft_n"] >= t["draft_n_accepted"] > 0  # the shipped pair speculates
    assert t["tokens_per_pass"] > 1 and t["tree_nodes"] > 1 and t["passes"] >= 2
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in t.values())
    assert t["predicted_per_second"] == pytest.approx(19 / (t["predicted_ms"] / 1e3), rel=1e-6)
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert [e for e in events if "timings" in e][0]["timings"]["predicted_n"] == 20
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "timings" in events[-1]


def test_timings_of_a_one_token_run_are_finite(llm):
    c = llm.generate(PROMPT, max_tokens=1)
    t = timings(c.stats)
    assert t["predicted_n"] == 1 and t["predicted_per_token_ms"] == 0.0
    assert all(math.isfinite(v) for v in t.values())


def test_the_end_of_turn_token_is_not_listed(llm):
    tok = llm.tokenizer
    eos = next(iter(tok.eos_ids))
    lps = [TokenLogprob(65, -0.5, ((65, -0.5), (eos, -1.0))), TokenLogprob(eos, -0.1)]
    c = chat_logprobs(tok, lps)["content"]
    assert len(c) == 1 and c[0]["token"] == tok.token_bytes(65).decode() and len(c[0]["top_logprobs"]) == 2
    d = completion_logprobs(tok, lps, text_offset=7)
    assert d["token_logprobs"] == [-0.5] and d["text_offset"] == [7]


def test_tokenize_and_detokenize_are_the_tokenizers(server, llm):
    url, tok = server[1], llm.tokenizer
    text = "def f(x):\n    return x  # é"
    assert httpx.post(url + "/tokenize", json={"content": text}).json() == {"tokens": tok.encode(text, add_bos=False)}
    with_bos = httpx.post(url + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == tok.encode(text, add_bos=True)
    pieces = httpx.post(url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode(text, add_bos=False)
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces) == text.encode()  # "é" may split into bytes that are not UTF-8 alone
    ids = tok.encode(text, add_bos=False)
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"content": tok.decode(ids)}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"), ("/tokenize", {"content": 3}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_token_requests_get_400_naming_the_field(server, path, body, param):
    r = httpx.post(server[1] + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
