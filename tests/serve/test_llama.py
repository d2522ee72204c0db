"""llama-server's own routes on `lever serve` (lever.serve.llama): /completion (and /completions)
in its shapes, equal to the API's output; its prompt shapes (ids and strings, objects, several
prompts answered as a list), n_probs, response_fields; OpenAI's routes without /v1, `n` choices,
__verbose; /apply-template; /props and /slots of `--parallel` slots; /models' aliases and tags;
a prompt past the context as exceed_context_size_error; /chat/completions/input_tokens; /infill's
fill-in-the-middle on the Qwen pair equal to plain greedy decoding of the same FIM prompt."""

from __future__ import annotations

import json

import httpx
import pytest

import lever
from lever.gguf.fim import Extra, FimTokens, fim_ids
from tests.serve.live import start_server, stop

PROMPT = "def parse_args(argv):"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[1] + path, json=body, timeout=300)


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server[1] + path, json=body, timeout=300) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")
                and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def server():
    """Two slots of 256 tokens (llama-server's --parallel and --ctx-size), two names and tags."""
    proc, url = start_server("--parallel", "2", "--ctx-size", "512", "--alias", "b-name,a-name", "--tags", "small,code")
    yield proc, url
    stop(proc)


def test_completion_in_llama_servers_shape_equals_the_api(server, llm):
    want = llm.generate(PROMPT, max_tokens=20)
    body = post(server, "/completion", {"prompt": PROMPT, "n_predict": 20, "return_tokens": True}).json()
    assert body["content"] == want.text and body["tokens"] == list(want.tokens) and body["stop"] is True
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 20
    assert body["tokens_evaluated"] == want.usage.prompt_tokens and body["timings"]["predicted_n"] == 20
    assert body["generation_settings"]["n_predict"] == 20 and isinstance(body["has_new_line"], bool)
    # a prompt of token ids is that prompt; without return_tokens, no ids
    ids = llm.tokenizer.encode(PROMPT)
    again = post(server, "/completion", {"prompt": ids, "n_predict": 20}).json()
    assert again["content"] == want.text and again["tokens"] == []


def test_a_streamed_completion_is_the_same_text_with_its_ids(server):
    whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "return_tokens": True}).json()
    evs = events(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "stream": True})
    assert all(isinstance(e["stop"], bool) for e in evs) and evs[-1]["stop"] and not any(e["stop"] for e in evs[:-1])
    assert "".join(e["content"] for e in evs) == whole["content"]
    assert [t for e in evs[:-1] for t in e["tokens"]] == whole["tokens"]
    assert evs[-1]["stop_type"] == "limit" and evs[-1]["timings"]["predicted_n"] == 16


def test_openai_routes_answer_without_v1_and_chats_start_with_null_content(server):
    with_v1 = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}).json()
    # llama-server's /completions is its own /completion, not OpenAI's
    native = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 8}).json()
    assert with_v1["choices"][0]["text"] == native["content"] and with_v1["system_fingerprint"].startswith("b")
    assert httpx.get(server[1] + "/models").json()["data"][0]["id"] == "a-name"
    assert httpx.get(server[1] + "/v1/health").status_code == 200
    msgs = [{"role": "user", "content": [{"type": "text", "text": "import"}, {"type": "text", "text": "os"}]}]
    evs = events(server, "/chat/completions", {"messages": msgs, "max_tokens": 4, "stream": True})
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    joined = [{"role": "user", "content": "import\nos"}]  # text parts joined by lines, as llama-server joins them
    assert post(server, "/apply-template", {"messages": msgs}).json() == \
        post(server, "/apply-template", {"messages": joined}).json()
    bad = post(server, "/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert bad.status_code == 400 and "content[0]" in bad.json()["error"]["message"]


def test_bad_ids_are_named(server):
    r = post(server, "/completion", {"prompt": [1, 2, 10**9], "n_predict": 2})
    assert r.status_code == 400 and "1000000000" in r.json()["error"]["message"]


def test_infill_needs_fim_tokens(server):
    r = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 4})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


CASES = [("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n", []),
         ("import os\n\ndef size(path):\n    return ", "\n", [Extra("util.py", "X = 1\n")]),
         ("class Point:\n    def __init__(self, x, y):\n        ", "\n    def norm(self):\n        return 0\n", [])]


@pytest.fixture(scope="module")
def qwen_server(qwen_target, qwen_draft):
    s = start_server("-m", str(qwen_target), "-md", str(qwen_draft), "--ctx-size", "1024", template=None)
    yield s
    stop(s[0])


@pytest.mark.parametrize("prefix,suffix,extra", CASES)
def test_infill_equals_greedy_decoding_of_the_fim_prompt(qwen_server, qwen_target, prefix, suffix, extra):
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 24, "return_tokens": True,
            "input_extra": [{"filename": x.filename, "text": x.text} for x in extra]}
    got = post(qwen_server, "/infill", body).json()
    with lever.load(target=qwen_target, kind="flash-ar", n_ctx=1024) as ar:  # the target's own greedy decoding
        assert FimTokens.of(ar.tokenizer).prefix in (ids := fim_ids(ar.tokenizer, prefix=prefix, suffix=suffix,
                                                                    extra=extra, n_room=1024 - 24))
        want = ar.run(ar.prepare(ids=ids, max_tokens=24))
    assert got["tokens"] == list(want.tokens) and got["content"] == want.text
    assert got["tokens_evaluated"] == len(ids)


def test_prompt_shapes_are_llama_servers(server, llm):
    """A prompt of ids with strings among them is those strings' ids in place; an object's
    prompt_string is its text; several prompts get a list of answers, each its own prompt's."""
    ids = llm.tokenizer.encode(PROMPT)
    want = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8}).json()["content"]
    head, tail = PROMPT[:6], PROMPT[6:]
    tail_ids = llm.tokenizer.encode(tail, add_bos=False)
    mixed = post(server, "/completion", {"prompt": [head, *tail_ids], "n_predict": 8}).json()
    assert mixed["tokens_evaluated"] == len(llm.tokenizer.encode(head)) + len(tail_ids)
    assert post(server, "/completion", {"prompt": {"prompt_string": PROMPT}, "n_predict": 8}).json()["content"] == want
    several = post(server, "/completion", {"prompt": [ids, PROMPT, {"prompt_string": "import os"}], "n_predict": 8})
    bodies = several.json()
    assert isinstance(bodies, list) and [b["index"] for b in bodies] == [0, 1, 2]
    assert bodies[0]["content"] == bodies[1]["content"] == want and bodies[2]["prompt"].endswith("import os")
    r = post(server, "/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}})
    assert r.status_code == 400 and "multimodal_data" in r.json()["error"]["message"]
    # OpenAI's completions take several prompts too: one choice each
    r = post(server, "/v1/completions", {"prompt": [PROMPT, "import os"], "max_tokens": 8}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["choices"][0]["text"] == want


def test_n_probs_and_response_fields(server, llm):
    want = llm.generate(PROMPT, max_tokens=5, logprobs=3)
    body = post(server, "/completion", {"prompt": PROMPT, "n_predict": 5, "n_probs": 3}).json()
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == list(want.tokens) and all(len(p["top_logprobs"]) == 3 for p in probs)
    assert [p["logprob"] for p in probs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-3)
    assert all(p["bytes"] == list(llm.tokenizer.token_bytes(p["id"])) for p in probs)
    # streamed: an event per token, each with its own probabilities, the text the same
    evs = events(server, "/completion", {"prompt": PROMPT, "n_predict": 5, "n_probs": 3, "stream": True})
    pieces = [e for e in evs if not e["stop"]]
    assert [e["completion_probabilities"][0]["id"] for e in pieces] == list(want.tokens)
    assert "".join(e["content"] for e in evs) == body["content"]
    # post-sampling probabilities only where sampling draws from the model's own distribution
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 2, "n_probs": 2, "post_sampling_probs": True,
                                     "temperature": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "post_sampling_probs"
    off = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1}  # no cut: the model's own
    plain = post(server, "/completion", {"prompt": PROMPT, "n_predict": 2, "n_probs": 2, "post_sampling_probs": True,
                                         **off}).json()
    assert all(0 < p["prob"] <= 1 and len(p["top_probs"]) == 2 for p in plain["completion_probabilities"])
    fields = post(server, "/completion", {"prompt": PROMPT, "n_predict": 4,
                                          "response_fields": ["content", "generation_settings/n_predict"]}).json()
    assert set(fields) == {"content", "generation_settings/n_predict"} and fields["generation_settings/n_predict"] == 4


def test_n_choices_and_verbose(server, llm):
    """n choices run one after another: greedy ones are equal, seeded ones each their own seed
    (seed, seed + 1, ...), as llama-server's; `verbose` adds llama-server's own answer."""
    msgs = [{"role": "user", "content": "import os"}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "n": 2, "verbose": True}).json()
    texts = [c["message"]["content"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1] and texts[0] == texts[1] == llm.chat(msgs, max_tokens=6).text
    assert r["usage"]["completion_tokens"] == 12 and r["__verbose"]["content"] == texts[0]
    ids = llm.prepare(messages=msgs).ids
    assert r["__verbose"]["prompt"] == b"".join(llm.tokenizer.token_bytes(i) for i in ids).decode()
    seeded = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "n": 2, "seed": 7,
                                              "temperature": 1.0}).json()
    again = [post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "seed": s, "temperature": 1.0}
                  ).json()["choices"][0]["text"] for s in (7, 8)]
    assert [c["text"] for c in seeded["choices"]] == again
    assert "__verbose" not in post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 3})
    assert r.status_code == 400 and "--parallel" in r.json()["error"]["message"]


def test_a_prompt_past_the_context_is_llama_servers_error_streamed_or_not(server):
    msgs = [{"role": "user", "content": "import os " * 400}]
    for body in ({"messages": msgs}, {"messages": msgs, "stream": True}):
        r = post(server, "/v1/chat/completions", body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == 256
        assert err["n_prompt_tokens"] > 256


def test_input_tokens_props_slots_and_models(server, llm):
    msgs = [{"role": "user", "content": "import os"}]
    n = post(server, "/chat/completions/input_tokens", {"messages": msgs})
    assert n.json() == {"input_tokens": len(llm.prepare(messages=msgs).ids), "object": "response.input_tokens"}
    props = httpx.get(server[1] + "/props").json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 256  # 512 / 2
    assert props["build_info"].startswith("b")
    slots = httpx.get(server[1] + "/slots").json()
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots] == [(0, 256, False), (1, 256, False)]
    assert "params" not in slots[0]  # no task yet
    model = httpx.get(server[1] + "/v1/models").json()["data"][0]
    assert (model["id"], model["aliases"], model["tags"]) == ("a-name", ["a-name", "b-name"], ["code", "small"])


def test_a_streams_progress_and_timings_per_token(server):
    """return_progress: the prefill's start (processed = cached) and end (processed = total),
    before the first piece; timings_per_token: each piece's timings so far, never going back."""
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True, "return_progress": True, "timings_per_token": True}
    for path, text_of in (("/completion", lambda e: e.get("content")),
                          ("/v1/completions", lambda e: (e.get("choices") or [{}])[0].get("text"))):
        evs = events(server, path, body)
        progress = [e for e in evs if "prompt_progress" in e]
        assert len(progress) == 2 and evs[:2] == progress
        start, end = (e["prompt_progress"] for e in progress)
        assert start["processed"] == start["cache"] == end["cache"] and end["processed"] == end["total"] > 0
        assert progress[0]["timings"]["prompt_n"] == 0 and progress[0]["timings"]["prompt_ms"] == 0
        pieces = [e for e in evs[2:] if text_of(e)]
        seen = [e["timings"]["predicted_n"] for e in pieces]
        assert seen == sorted(seen) and seen[-1] <= 8 and all(v >= 0 for e in pieces for v in e["timings"].values())
    plain = events(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "stream": True})
    assert not any("prompt_progress" in e or ("timings" in e and not e["stop"]) for e in plain)


def test_a_streams_usage_chunk_carries_the_timings(server):
    evs = events(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "import os"}],
                                                  "max_tokens": 5, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == evs[-1]["timings"]["predicted_n"]


def test_n_predict_minus_one_runs_until_the_slots_context_is_full(server):
    """llama-server's -1: no limit but the context (a slot's 256 here); the text fills it, prompt
    and reply, and says it was cut there (truncated); a reply that ends before is not."""
    full = post(server, "/completion", {"prompt": PROMPT, "n_predict": -1, "ignore_eos": True}).json()
    t = full["timings"]
    assert t["prompt_n"] + t.get("cache_n", 0) + t["predicted_n"] == 256 and full["truncated"] is True
    assert full["stop_type"] == "limit"
    short = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8}).json()
    assert short["truncated"] is False and short["timings"]["predicted_n"] == 8
    streamed = events(server, "/completion", {"prompt": PROMPT, "n_predict": -1, "ignore_eos": True, "stream": True})
    assert streamed[-1]["truncated"] is True and "".join(e["content"] for e in streamed) == full["content"]
