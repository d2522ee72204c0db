"""`lever bench clients`: N clients at once against `lever serve --parallel N`; its figures and
--json, Lever's answers at N clients against its answers at one (the same prompts), and its
refusals. Nothing timed: the speeds are the bench's to print, not a test's to hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lever.shipped import shipped

PAIR = ["-m", str(shipped("models/stdlib-target-q4_0.gguf")), "-md", str(shipped("models/stdlib-draft-q8_0.gguf"))]


def bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lever", "bench", "clients", *PAIR, *args], capture_output=True,
                          text=True, timeout=timeout)


def test_clients_at_once_get_what_one_client_gets(tmp_path):
    out = tmp_path / "clients.json"
    p = bench("--rows", "lever", "--clients", "1,3", "--requests", "2", "--n-predict", "8", "--slot-ctx", "128",
              "--prompt-lines", "3", "--lever-set", "flash.dram_budget=0", "--json", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    one, three = doc["runs"]["lever"]["1"], doc["runs"]["lever"]["3"]
    assert one["failed"] == three["failed"] == 0
    assert len(three["results"]) == 3 and all(len(rs) == 2 for rs in three["results"])
    assert three["tokens"] == sum(r["n_predicted"] for rs in three["results"] for r in rs) > 0
    assert len(one["results"]) == 1 and len(one["results"][0]) == 6  # one client asks every prompt, alone
    assert doc["summary"]["same_as_one_client"] == {"1": "6/6", "3": "6/6"}
    assert three["read_bytes"] > 0 and three["mb_per_token"] > 0  # every layer streamed: read from storage
    assert "Lever at 3 clients: over one client" in p.stdout


@pytest.mark.parametrize("args, says", [
    (["--rows", "lever,nope"], "--rows"),
    (["--clients", "0"], "--clients"),
    (["--rows", "lever", "--cap", "100M"], "--cap"),
])
def test_bad_arguments_are_one_line(args, says):
    p = bench(*args, timeout=120)
    assert p.returncode != 0 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
