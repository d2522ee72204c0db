"""A live memory budget under the kernel's own memory cgroup (issue 50): `lever run` on a deep target
made from the shipped pair, its cap lowered and raised while it generates, as a phone's OS does
(and ../shared/tools/memcap --then): never killed, the same text as the run no change touched,
within each cap in time; below its floor, one line and a non-zero exit rather than a kill.

The moves are made on what the run prints (its first generated text), not on a clock, so a loaded
machine makes them later, never wrongly; the grace a lowered cap waits before it kills is longer
than memcap's (2 s) for the same reason, and how long each took is asserted far under it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from lever.cli.bench.cgroup import _controller, held_bytes, memory_group, write_limit
from lever.shipped import shipped
from tests.cli.test_bench_cap import needs_cgroup
from tests.deep_target import write_deep_target
from tests.serve.live import start_server, stop

MIB = 1 << 20
PROMPT = "def read_config(path):\n"
GRACE_S = 10.0  # a lowered cap not met by then kills, as a low-memory killer does
HIGH = 1024 * MIB  # holds every layer of the deep target resident


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """The shipped target 48 times as deep (288 blocks, ~340 MB: layers worth dropping)."""
    d = tmp_path_factory.mktemp("live")
    return write_deep_target(shipped("models", "stdlib-target-q4_0.gguf"), d / "deep48.gguf", 48)


def lever_cmd(deep, *extra: str) -> list[str]:
    draft = shipped("models", "stdlib-draft-q8_0.gguf")
    return [sys.executable, "-m", "lever", "run", "-m", str(deep), "-md", str(draft), "-p", PROMPT,
            "-n", "160", "--mem", str(HIGH), "--ctx-size", "512", *extra]


def drive(cmd: list[str], moves: list[tuple[int, int]], grace_s: float = GRACE_S, start: int = HIGH) -> dict:
    """Runs `cmd` in a memory cgroup of `start`; when its stdout has passed `chars` characters, its
    cap becomes `cap` (retried until the kernel takes it, killed after GRACE_S). What it printed,
    how it ended, how long each move took, and the group's usage over time."""
    _, limit_file, _ = _controller()
    with memory_group(start) as group:
        proc = subprocess.Popen(group.joined(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
        reader.start()
        took, samples, killed, pending = [], [], False, list(moves)
        while proc.poll() is None:
            if pending and len(out) >= pending[0][0]:
                _, cap = pending.pop(0)
                t0 = time.monotonic()
                while not write_limit(group.path / limit_file, cap) and time.monotonic() - t0 < grace_s:
                    time.sleep(0.02)
                took.append(time.monotonic() - t0)
                if took[-1] >= grace_s:
                    proc.kill()
                    killed = True
            samples.append((len(took), held_bytes(group.path)))
            time.sleep(0.02)
        reader.join(30)
        return {"rc": proc.returncode, "out": "".join(out), "err": proc.stderr.read(), "took": took,
                "samples": samples, "killed": killed}


@pytest.fixture(scope="module")
def reference(deep):
    """The run no change touches: its text, the most its group held, and its plan (every layer
    resident under HIGH)."""
    plan = json.loads(subprocess.run(lever_cmd(deep, "--json"), capture_output=True, text=True, check=True,
                                     timeout=600).stdout)["memory"]["plan"]
    ref = drive(lever_cmd(deep), [])
    assert ref["rc"] == 0 and len(ref["out"]) > len(PROMPT) + 200, ref["err"][-400:]
    return ref, max(h for _, h in ref["samples"]), plan


@needs_cgroup
def test_a_cap_lowered_then_raised_mid_generation_leaves_the_text_and_the_run_alive(deep, reference):
    ref, held, plan = reference
    layers = plan["resident_layer_bytes"]
    low = held - layers // 4  # below what it holds: a quarter of the layers' bytes must go
    moves = [(len(PROMPT) + 1, low), (len(PROMPT) + 60, HIGH)]
    # the move is real: a run that does not follow the cgroup is killed by it
    assert drive(lever_cmd(deep, "--set", "memory.follow=false"), moves[:1], grace_s=3.0)["killed"]
    got = drive(lever_cmd(deep), moves)
    assert not got["killed"] and got["rc"] == 0, got["err"][-400:]
    assert got["out"] == ref["out"]  # lossless: the same text as the run no change touched
    assert len(got["took"]) == 2 and got["took"][0] < GRACE_S / 2  # the lowered cap was met, well within the grace
    under_low = [h for phase, h in got["samples"] if phase == 1]
    after = [h for phase, h in got["samples"] if phase == 2]
    assert under_low and max(under_low) <= low
    # raised again, it read layers back: it came to hold a good part of them again
    assert after and max(after) - under_low[-1] > layers // 4


@needs_cgroup
def test_a_cap_below_the_plan_from_the_start_is_followed_before_the_layers_load(deep, reference):
    # `--mem HIGH` in a group that grants less: the layers the plan would load do not fit, and a
    # load that went on to its plan is killed by the kernel (anonymous memory cannot be reclaimed)
    ref, held, plan = reference
    low = held - plan["resident_layer_bytes"] // 4
    assert drive(lever_cmd(deep, "--set", "memory.follow=false"), [], start=low)["rc"] == -9  # the cap is real
    got = drive(lever_cmd(deep, "--json"), [], start=low)
    assert got["rc"] == 0, got["err"][-400:]
    res = json.loads(got["out"])
    assert PROMPT + res["text"] + "\n" == ref["out"]  # lossless
    assert max(h for _, h in got["samples"]) <= low
    assert res["memory_events"][0][1] == "limit" and res["memory_events"][0][2] <= low


@needs_cgroup
def test_a_cap_below_the_floor_stops_the_run_with_one_line_not_a_kill(deep, reference):
    _, _, plan = reference
    floor_less = sum(plan.values()) - plan["resident_layer_bytes"] - 128 * MIB
    got = drive(lever_cmd(deep), [(len(PROMPT) + 1, floor_less)])
    assert not got["killed"] and got["rc"] == 1, got["err"][-400:]
    last = got["err"].strip().splitlines()[-1]
    assert "below this run's floor of" in last  # cgroup v1 shows no cap it has not met: the floor is what it names
    assert got["took"][0] < GRACE_S / 2  # it gave the memory back by stopping, well within the grace


@pytest.fixture(scope="module")
def deeper(tmp_path_factory):
    """The shipped target 128 times as deep (768 blocks, ~650 MB): a server's plan counts its own
    parts and its process's mapped libraries, which the cgroup may not charge it, so its floor is
    above what it holds unless its layers are many."""
    d = tmp_path_factory.mktemp("live")
    return write_deep_target(shipped("models", "stdlib-target-q4_0.gguf"), d / "deep128.gguf", 128)


@needs_cgroup
def test_a_server_under_the_same_moves_answers_every_streamed_request_as_alone(deeper):
    key = {"Authorization": "Bearer live-test"}
    body = {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "cache_prompt": False}
    _, limit_file, _ = _controller()
    high = 1536 * MIB  # the server's own parts beside the run: every layer resident still
    with memory_group(high) as group:
        proc, url = start_server("-m", str(deeper), "-md", str(shipped("models", "stdlib-draft-q8_0.gguf")),
                                 "--mem", str(high), "--ctx-size", "512", "--api-key", "live-test", "--no-page",
                                 "--cache-ram", "16", headers=key, wrap=group.joined, template=None)
        try:
            want = httpx.post(url + "/completion", json=body, headers=key, timeout=300).json()["content"]
            # the least its plan may hold (every layer streamed, its requests' and conversations' parts kept),
            # with room for a few layers: below what it holds now, so layers must go
            floor = httpx.get(url + "/admin/memory", headers=key, timeout=60).json()["floor_bytes"]
            low = floor + 16 * MIB
            assert low < held_bytes(group.path) - 16 * MIB
            chunks, answers, took = [], [], []

            def client():  # streams one request after another while the cap moves
                for _ in range(3):
                    text, status = "", None
                    with httpx.stream("POST", url + "/completion", json=body | {"stream": True}, headers=key,
                                      timeout=300) as r:
                        status = r.status_code
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                text += json.loads(line[6:]).get("content", "")
                                chunks.append(1)
                    answers.append((status, text))

            t = threading.Thread(target=client)
            t.start()
            for at, cap in ((1, low), (24, high)):
                while len(chunks) < at and t.is_alive():
                    time.sleep(0.01)
                t0 = time.monotonic()
                while not write_limit(group.path / limit_file, cap) and time.monotonic() - t0 < GRACE_S:
                    time.sleep(0.02)
                took.append(time.monotonic() - t0)
                assert took[-1] < GRACE_S / 2, f"the server did not make room for {cap >> 20} MiB in time"
            t.join(600)
            assert proc.poll() is None  # alive
            assert answers == [(200, want)] * 3  # no request lost, none failed, each as alone
        finally:
            stop(proc)
