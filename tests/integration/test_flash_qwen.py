"""Flash-AR on the real Qwen2.5-Coder-1.5B target: lossless, flash is real, memory is bounded.

Each run is its own `lever run --json` process, so the device-read counter (/proc/self/io)
and peak RSS belong to that configuration alone.
"""

from __future__ import annotations

import pytest

from lever.cli.bench.child import run_json
from tests.conftest import ROOT

CONFIG = str(ROOT / "examples" / "flash-ar.toml")
PROMPT = "def fibonacci(n):"
N = 10
DEVICE_BYTES_RTOL = 0.10  # device bytes per token within 10% of the streamed bytes per pass


def flash_run(qwen_target, *sets) -> dict:
    return run_json(CONFIG, [f'model.target="{qwen_target}"', *sets], PROMPT, N)


@pytest.fixture(scope="module")
def resident(qwen_target):
    return flash_run(qwen_target, 'pipeline.kind="resident-ar"')


def read_whole_file(path) -> None:
    """Leave the file in the page cache, as a user who just copied it would."""
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


@pytest.mark.parametrize("mode", ["direct", "mmap"])
def test_flash_ar_equals_resident_and_reads_the_device(qwen_target, resident, mode):
    read_whole_file(qwen_target)
    r = flash_run(qwen_target, f'flash.mode="{mode}"', "flash.dram_budget=0.25")
    assert r["tokens"] == resident["tokens"]
    per_token = r["flash_mb_per_token"] * 1e6
    print(f"{mode}: {per_token / 1e6:.1f} MB/token from the device "
          f"for {r['flash']['streamed_bytes_per_pass'] / 1e6:.1f} MB "
          f"streamed per pass; {r['ms_per_token']:.0f} ms/token; peak RSS {r['memory']['peak_rss_bytes'] >> 20} MiB")
    assert abs(per_token / r["flash"]["streamed_bytes_per_pass"] - 1) < DEVICE_BYTES_RTOL


@pytest.mark.parametrize("budget", ["0", "0.5"])
def test_peak_rss_within_planned_memory(qwen_target, budget):
    r = flash_run(qwen_target, f"flash.dram_budget={budget}")
    assert r["memory"]["peak_rss_bytes"] <= r["memory"]["rss_bound_bytes"], (
        f"peak RSS {r['memory']['peak_rss_bytes'] >> 20} MiB over the plan with margin, "
        f"{r['memory']['rss_bound_bytes'] >> 20} MiB")


@pytest.mark.parametrize("policy", ["chain", "gain-cost"])
def test_speculative_equals_autoregressive_on_the_qwen_pair(qwen_target, qwen_draft, resident, policy):
    r = flash_run(qwen_target, 'pipeline.kind="speculative"', f'model.draft="{qwen_draft}"',
                  f'tree_expand.policy="{policy}"', "flash.dram_budget=0.25")
    print(f"{policy}: {r['tree']['accepted_per_pass']:.2f} tokens/pass "
          f"from trees of {r['tree']['mean_nodes']:.1f} nodes, "
          f"{r['ms_per_token']:.0f} ms/token")
    assert r["tokens"] == resident["tokens"]
    assert r["tree"]["accepted_per_pass"] > 1.0
