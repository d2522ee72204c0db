"""lever.policy.memory: the plan made from headers equals what the run allocates, a plan over the limit
or the machine is refused before anything loads, and peak RSS stays within plan + margin, also
over a run of thousands of tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import attrs
import numpy as np
import psutil
import pytest

from lever.config import load_config
from lever.errors import LeverError
from lever.pipelines.engine import run_pipeline
from lever.pipelines.plan import RunPlan
from lever.pipelines.target import FlashTarget
from lever.policy import memory

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "default.toml"
# A long run may touch more of its (preallocated) KV cache as it goes, nothing else: RSS late in
# the run may exceed RSS early in it by the cache's bytes plus this much (allocator noise).
GROWTH_SLACK_BYTES = 8 * 2**20
BALLAST_BYTES = 512 * 2**20
ALONE = ("--set", 'pipeline.baseline=""')  # the shipped config's Flash-AR baseline opens a second engine


def lever_json(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "lever", "run", "--json", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("sets", [
    [],  # the shipped pair, speculative, every layer streamed
    ["flash.dram_budget=1.0"],
    ["flash.dram_budget=0.5", 'flash.mode="mmap"'],
    ['pipeline.kind="flash-ar"', 'pipeline.baseline=""'],
])
def test_plan_parts_equal_what_the_run_allocates(sets):
    res = run_pipeline(load_config(DEFAULT, ["generate.n_predict=8", 'pipeline.baseline=""', *sets]), "def f(x):")
    plan, used = res.memory.plan, res.memory
    assert plan.resident_layer_bytes == used.resident_layer_bytes
    assert plan.head_bytes == used.head_bytes
    assert plan.kv_cache_bytes == res.verify.kv_cache_bytes
    assert plan.draft_bytes == res.draft_bytes
    chunks = 0 if "mmap" not in str(sets) else plan.window_bytes - used.window_bytes
    assert plan.window_bytes == used.window_bytes + chunks
    assert plan.total_bytes == sum(attrs.astuple(plan)) and plan.total_bytes > plan.process_bytes


@pytest.mark.parametrize("sets", [
    [],
    ["flash.dram_budget=1.0"],
    ['flash.mode="mmap"', "flash.dram_budget=0.25"],
])
def test_peak_rss_within_the_plan_and_margin(sets):
    """A fresh process each, so its peak RSS is this run's, started from a parent made bigger
    than any bound here: Linux carries getrusage's peak across execve, which once reported
    the test runner's peak as the run's."""
    ballast = np.ones(BALLAST_BYTES // 8)  # noqa: F841 (touched, so resident)
    r = lever_json("-n", "48", *(a for s in sets for a in ("--set", s)))
    assert r["memory"]["peak_rss_bytes"] <= r["memory"]["rss_bound_bytes"], (
        r["memory"]["peak_rss_bytes"] >> 20, r["memory"])


def test_over_the_limit_is_refused_before_loading(monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the target was opened before the memory check")

    monkeypatch.setattr(FlashTarget, "open", no_loading)
    cfg = load_config(DEFAULT, ['memory.limit="40MiB"'])
    with pytest.raises(LeverError) as e:
        run_pipeline(cfg, "def f(x):")
    msg = str(e.value)
    assert "\n" not in msg and "[memory] limit" in msg and "40 MiB" in msg and "KV cache" in msg and "window" in msg


def test_over_what_the_machine_has_is_refused(monkeypatch):
    real = psutil.virtual_memory()
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: real._replace(available=2**20))
    with pytest.raises(LeverError, match=r"the machine has 1 MiB available"):
        run_pipeline(load_config(DEFAULT), "def f(x):")


@pytest.mark.parametrize("value", ["lots", 0, -5, "25%", "8L", True])
def test_bad_limit_names_key_and_value(value):
    with pytest.raises(LeverError, match=r"\[memory\] limit"):
        load_config(None, [f"memory.limit={json.dumps(value)}"])


def test_refusal_is_one_line_from_the_cli():
    proc = subprocess.run([sys.executable, "-m", "lever", "run", "-n", "4", "--set", 'memory.limit="1MiB"'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "pipeline" not in proc.stdout + proc.stderr  # no run, no summary
    assert len(proc.stderr.strip().splitlines()) == 1 and "[memory] limit" in proc.stderr


def test_fill_keeps_the_most_evenly_spread_layers_the_limit_holds():
    def plan(resident):  # 4 layers of 10 bytes; a window of 10 while any layer streams
        return memory.MemoryPlan(10 * len(resident), 0, 10 if len(resident) < 4 else 0, 0, 0, 0, 100, slack_bytes=0)

    assert memory.fill_residency(135, 4, plan)[0] == frozenset({1, 3})  # 130: a third layer would need 140
    chosen, p = memory.fill_residency(140, 4, plan)
    assert chosen == frozenset(range(4)) and p.window_bytes == 0  # the last streamed layer takes the window with it
    assert memory.fill_residency(110, 4, plan)[0] == frozenset()
    with pytest.raises(LeverError, match=r"\[memory\] limit: 0 MiB does not hold this run even with every layer "
                                         r"streamed"):
        memory.fill_residency(105, 4, plan)


@pytest.mark.parametrize("room_mib", [300, 4096])
def test_fill_with_an_auto_limit_fills_a_share_of_the_room_there_is(monkeypatch, room_mib):
    """[memory] limit = "auto" (the default; `-m` with no --mem): "fill" plans inside
    AUTO_FILL_SHARE of what the machine (or its cgroup) has available now, whatever that is. The
    process's RSS is fixed (a long test session's would not fit the small room)."""
    monkeypatch.setattr(memory, "room_bytes", lambda: (room_mib * 2**20, "the machine"))
    monkeypatch.setattr(memory.psutil, "Process", lambda: types.SimpleNamespace(
        memory_info=lambda: types.SimpleNamespace(rss=100 * 2**20)))
    plan = RunPlan.resolve(load_config(DEFAULT, ['pipeline.baseline=""', 'flash.dram_budget="fill"']))
    assert plan.memory.limit == "auto"
    assert plan.fill.total_bytes <= memory.AUTO_FILL_SHARE * room_mib * 2**20
    every = RunPlan.resolve(load_config(DEFAULT, ['pipeline.baseline=""', 'memory.limit="64G"',
                                                  'flash.dram_budget="fill"']))
    assert plan.resident == every.resident  # the tiny shipped target fits either room whole


def test_an_auto_limit_too_small_says_to_give_one(monkeypatch):
    monkeypatch.setattr(memory, "room_bytes", lambda: (2**20, "the machine"))
    with pytest.raises(LeverError, match=r'\[memory\] limit \("auto".*--mem.*\): \d+ MiB does not hold this run'):
        RunPlan.resolve(load_config(DEFAULT, ['pipeline.baseline=""', 'flash.dram_budget="fill"']))


def test_fill_keeps_resident_what_the_limit_leaves(monkeypatch):
    """A limit between streaming everything and keeping everything: some layers resident and
    the plan inside it; a --set of the budget after it wins. The process's RSS is fixed here: it
    moves by a few MiB from run to run, as much as the tiny target's layers weigh."""
    monkeypatch.setattr(memory.psutil, "Process", lambda: types.SimpleNamespace(
        memory_info=lambda: types.SimpleNamespace(rss=100 * 2**20)))

    def resolve(*sets):
        return RunPlan.resolve(load_config(DEFAULT, ['pipeline.baseline=""', *sets]))

    every = resolve('memory.limit="64G"', 'flash.dram_budget="fill"')
    layers = every.fill.resident_layer_bytes
    assert every.resident == frozenset(range(every.spec.n_layer)) and every.fill.window_bytes == 0
    window = resolve("flash.dram_budget=0")
    floor = every.fill.total_bytes - layers + memory.plan_memory(
        window.target_file, window.spec, window.flash, n_ctx=window.n_ctx, n_pass_tokens=1).window_bytes
    limit = floor + layers // 4  # a quarter: the window that leaves with the last streamed layer weighs half here
    half = resolve(f"memory.limit={limit}", 'flash.dram_budget="fill"')
    assert 0 < half.fill.resident_layer_bytes < layers and half.fill.total_bytes <= limit
    assert 0 < len(half.resident) < every.spec.n_layer
    assert resolve(f"memory.limit={limit}", 'flash.dram_budget="fill"', "flash.dram_budget=0").resident == frozenset()


def test_a_fill_to_the_byte_opens_though_the_process_grew_after_it_was_planned(monkeypatch):
    """A limit the fill's plan meets to the byte, and the process a few MiB bigger by the time
    the engine opens (imports, the tokenizer): the engine holds to the plan the fill made, not
    a refusal of it."""
    from lever.pipelines.engine import Engine

    rss = [100 * 2**20]
    monkeypatch.setattr(memory.psutil, "Process", lambda: types.SimpleNamespace(
        memory_info=lambda: types.SimpleNamespace(rss=rss[0])))
    sets = ['pipeline.baseline=""', 'flash.dram_budget="fill"']
    limit = RunPlan.resolve(load_config(DEFAULT, [*sets, 'memory.limit="64G"'])).fill.total_bytes
    resolve = RunPlan.resolve

    def grown(*args, **kw):
        plan = resolve(*args, **kw)
        rss[0] += 4 << 20
        return plan

    monkeypatch.setattr(RunPlan, "resolve", grown)
    with Engine.open(load_config(DEFAULT, [*sets, f"memory.limit={limit}"])) as engine:
        largest = engine.memory_plan(engine.plan.n_ctx - 1)  # a server's check: a prompt filling the context
        assert engine.plan.fill.total_bytes == limit and largest.total_bytes <= limit


def test_mem_runs_inside_its_plan_with_the_same_tokens():
    ballast = np.ones(BALLAST_BYTES // 8)  # noqa: F841 (a fresh process's peak is its own: see above)
    r = lever_json("-n", "8", *ALONE, "--mem", "1G")
    m = r["memory"]
    assert m["fill"]["resident_layer_bytes"] == m["plan"]["resident_layer_bytes"] > 0
    assert sum(m["plan"].values()) <= 2**30 and m["peak_rss_bytes"] <= m["rss_bound_bytes"]
    assert r["tokens"] == lever_json("-n", "8", *ALONE, "--set", "flash.dram_budget=0")["tokens"]


def test_a_mem_that_holds_nothing_is_one_line_naming_the_limit():
    proc = subprocess.run([sys.executable, "-m", "lever", "run", "-n", "4", "--mem", "64M"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "[memory] limit: 64 MiB does not hold this run even with every layer streamed" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "lever", "run", "--mem", "lots"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--mem: must be a positive size" in bad.stderr


def test_long_run_does_not_grow(tiny_model):
    """3,000 tokens through Flash-AR: RSS sampled from outside stays flat after the start (the KV
    cache is allocated for the whole context up front) and the peak within the plan."""
    path = tiny_model("llama", "F32", n_layer=2, n_ctx=4096)
    n = 3000
    # its output to files, not pipes read only at the end: a result of 3,000 passes is over a pipe's
    # 64 KiB, and the run would wait on a full pipe while this waits on the run
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lever", "run", "--json",
                                 "-c", str(ROOT / "examples" / "flash-ar.toml"), "-p", "the", "-n", str(n),
                                 "--set", f'model.target="{path}"', "--set", "model.n_ctx=4096"],
                                stdout=out, stderr=err, text=True)
        ps, samples = psutil.Process(proc.pid), []
        while proc.poll() is None:
            try:
                samples.append((time.monotonic(), ps.memory_info().rss))
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
        proc.wait()
        out.seek(0)
        err.seek(0)
        assert proc.returncode == 0, err.read()
        r = json.loads(out.read())
    assert len(r["tokens"]) == n and r["memory"]["peak_rss_bytes"] <= r["memory"]["rss_bound_bytes"]
    # Decoding, without the start (imports, prefill) and the end (the result and its text): RSS
    # over the last stretch against the first, each a median of samples so one spike is not growth.
    rss = [b for _, b in samples]
    assert len(rss) >= 40, "the run was too short to sample"
    k = len(rss) // 10
    early, late = sorted(rss[2 * k : 3 * k])[k // 2], sorted(rss[8 * k : 9 * k])[k // 2]
    assert late - early <= r["memory"]["plan"]["kv_cache_bytes"] + GROWTH_SLACK_BYTES, (early >> 20, late >> 20)


PARALLEL_RUN = """
import json, sys, threading
import lever
from lever.backends.cpu.kv_cache import KVCache
from lever.pipelines.engine import _peak_rss_bytes
from lever.shipped import shipped
n = int(sys.argv[1])
with lever.load(shipped("default.toml"), overrides=["pipeline.baseline=\\"\\"", f"pipeline.parallel={n}",
                                                   "model.n_ctx=256", "flash.dram_budget=0"]) as llm:
    prompts = ["def f(x):\\n", "import os\\n", "class A:\\n", "for i in range(10):\\n"][:n]
    threads = [threading.Thread(target=llm.generate, args=(p,), kwargs={"max_tokens": 48}) for p in prompts]
    for t in threads: t.start()
    for t in threads: t.join()
    plan = llm.memory_plan()
    p = llm.engine.plan
    one = KVCache.bytes_for(p.spec, p.n_ctx + p.tree.max_nodes)  # a generation's cache: the context and its tree
    print(json.dumps({"peak": _peak_rss_bytes(), "bound": plan.rss_bound_bytes, "kv": plan.kv_cache_bytes, "one": one,
                      "draft": plan.draft_bytes, "trees": b.trees if (b := llm.lanes.batcher) else 0,
                      "passes": b.passes if b else 0}))
"""


def test_generations_at_once_stay_within_a_plan_that_holds_each_ones_caches():
    """[pipeline] parallel 4: the plan holds four generations' caches (the target's and the
    draft's, each with rows for its tree's share of the pass), and four generations at once
    (sharing passes) keep the process's peak RSS within it."""
    ballast = np.ones(BALLAST_BYTES // 8)  # noqa: F841 (a parent bigger than any bound: see above)
    runs = {}
    for n in (1, 4):
        p = subprocess.run([sys.executable, "-c", PARALLEL_RUN, str(n)], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        runs[n] = json.loads(p.stdout)
    one, four = runs[1], runs[4]
    assert four["kv"] == 4 * four["one"] and one["kv"] == one["one"] and four["draft"] > one["draft"]
    assert four["passes"] < four["trees"]  # the four shared passes
    for n, r in runs.items():
        assert r["peak"] <= r["bound"], (n, r["peak"] >> 20, r["bound"] >> 20)
