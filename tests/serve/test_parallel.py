"""`lever serve --parallel N`: N generations at once, their trees verified in shared passes of the
streamed target, each giving what it gives alone (issue 49): greedy token for token, seeded
sampling the same draws, a grammar's text, stop strings where they cut; one cancelled
mid-stream leaves the others as they were; requests join and leave while others run."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx
import pytest

from tests.serve.live import start_server, stop

PROMPTS = ["def read_config(path):\n", "import os\n\n\ndef walk(root):\n", "class Stack:\n    def push(self, x):\n",
           "def fib(n):\n    if n < 2:\n", "for line in open(path):\n", "# parse the arguments\nimport argparse\n",
           "def merge(a, b):\n    out = []\n", "with open(name) as f:\n"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
N_SLOTS = 4


@pytest.fixture(scope="module")
def server():
    # every layer streamed: a pass shared is a read saved; each slot 128 tokens of context (the target trained on 512)
    proc, url = start_server("--parallel", str(N_SLOTS), "--ctx-size", str(128 * N_SLOTS), "--metrics",
                             "--set", "flash.dram_budget=0", queue=16)
    yield url
    stop(proc)


def body(kind: str, prompt: str, n: int) -> dict:
    """A llama-server /completion body of one of the kinds a client asks for."""
    b = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False}
    if kind == "sampled":
        b |= {"temperature": 0.8, "seed": 1 + len(prompt)}
    elif kind == "grammar":
        b |= {"json_schema": SCHEMA, "prompt": prompt + "# as JSON: "}
    elif kind == "stop":
        b |= {"stop": ["\n\n", "return"]}
    return b


def complete(url: str, b: dict) -> dict:
    r = httpx.post(url + "/completion", json=b | {"return_tokens": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def cancelled_stream(url: str, b: dict, chunks: int, out: list) -> None:
    """Streams `b` and leaves after `chunks` events (the server cancels it at its next pass)."""
    with httpx.stream("POST", url + "/completion", json=b | {"stream": True}, timeout=300) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break
    out.append(seen)


def metric(url: str, name: str, prefix: str = "llamacpp") -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^{prefix}:{name} (\S+)$", text, re.M).group(1))


def test_requests_at_once_each_give_what_they_give_alone(server):
    """Rounds of 2-6 requests of random kinds, prompts and lengths, started at random moments
    (some while others run, more than the slots so some wait): each equals its run alone."""
    rng = random.Random(49)
    for rnd in range(4):
        kinds = [rng.choice(["greedy", "sampled", "grammar", "stop"]) for _ in range(rng.randint(2, 6))]
        bodies = [body(k, rng.choice(PROMPTS), rng.randint(6, 28)) for k in kinds]
        starts = [rng.choice([0.0, 0.0, 0.3, 1.0]) for _ in bodies]
        got: dict[int, dict] = {}
        leaving: list[int] = []

        def one(i: int) -> None:
            time.sleep(starts[i])
            got[i] = complete(server, bodies[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        if rnd % 2:  # one more, streamed and left mid-way, beside them
            threads.append(threading.Thread(target=cancelled_stream, args=(
                server, body("greedy", rng.choice(PROMPTS), 64), 3, leaving)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert len(got) == len(bodies), f"round {rnd}: {len(got)} of {len(bodies)} answered"
        for i, b in enumerate(bodies):
            alone = complete(server, b)
            what = f"round {rnd}, request {i} ({kinds[i]}, started at {starts[i]} s)"
            assert got[i]["tokens"] == alone["tokens"], what
            assert got[i]["content"] == alone["content"], what
            if kinds[i] == "grammar" and got[i]["stop_type"] == "eos":
                assert isinstance(json.loads(got[i]["content"]), dict), what  # the grammar ended it: a whole object
            if kinds[i] == "stop":  # cut before the first stop string
                assert "\n\n" not in got[i]["content"] and "return" not in got[i]["content"], what
    assert metric(server, "n_busy_slots_per_decode") > 1  # some passes were shared (the runs alone: 1 a pass)
    trees, passes = metric(server, "shared_pass_trees_total", "lever"), metric(server, "shared_passes_total", "lever")
    assert trees / passes == pytest.approx(metric(server, "n_busy_slots_per_decode")) and trees > passes
    assert metric(server, "shared_pass_nodes_total", "lever") >= trees  # a tree holds its root at least
    assert metric(server, "shared_pass_seconds_total", "lever") > 0
    assert metric(server, "shared_pass_predicted_seconds_total", "lever") > 0  # priced by the shipped profile


def test_the_slots_show_the_generations_running_at_once(server):
    out: list = []
    threads = [threading.Thread(target=lambda p=p: out.append(complete(server, body("greedy", p, 24))))
               for p in PROMPTS[:3]]
    for t in threads:
        t.start()
    seen = 0
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        slots = httpx.get(server + "/slots", timeout=30).json()
        seen = max(seen, sum(s["is_processing"] for s in slots))
        time.sleep(0.05)
    for t in threads:
        t.join(300)
    assert len(out) == 3 and seen >= 2
    assert [s["n_ctx"] for s in httpx.get(server + "/slots", timeout=30).json()] == [128] * N_SLOTS


def test_conversations_at_once_keep_their_prefixes_across_the_slots(server):
    """More conversations than slots, each of three turns, all at once: every later turn is
    served from the caches (its earlier turns' prompt not prefilled again, whichever slot it
    lands in) and equals the same turn asked alone with nothing cached."""
    rng = random.Random(50)
    starts = rng.sample(PROMPTS, N_SLOTS + 2)
    turns: dict[int, list[tuple[dict, dict]]] = {i: [] for i in range(len(starts))}

    def talk(i: int) -> None:
        prompt = starts[i]
        for k in range(3):
            b = body("greedy", prompt, rng.randint(4, 12)) | {"cache_prompt": True}
            r = complete(server, b)
            turns[i].append((b, r))
            prompt = prompt + r["content"] + f"\n# turn {k + 2}\n"

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(starts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i, conv in turns.items():
        assert len(conv) == 3, f"conversation {i}: {len(conv)} of 3 turns answered"
        for k, (b, r) in enumerate(conv):
            what = f"conversation {i}, turn {k + 1}"
            if k:  # at least the previous turn's prompt came from a cache
                assert r["tokens_cached"] >= conv[k - 1][1]["tokens_evaluated"], what
            alone = complete(server, b | {"cache_prompt": False})
            assert (r["tokens"], r["content"]) == (alone["tokens"], alone["content"]), what
