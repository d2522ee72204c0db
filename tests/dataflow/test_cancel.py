"""Ctrl-C during a Lever run: in prefill, drafting, verification and a flash read, it stops
within a second and gives back every thread, descriptor and staging buffer.

The signal is real: a hook in the phase's own function (run on a worker thread, as in a real
run) sends SIGINT to this process, and asyncio's handler cancels the run the way it does under
`lever run`. The run then raises KeyboardInterrupt, not a RunResult.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lever.backends.flash import Faults, inject
from lever.pipelines.engine import run_pipeline
from lever.stages.draft import Drafter
from lever.stages.pruned_verify import PrunedVerify
from tests.backends.flash.test_faults import (  # noqa: F401 (fixtures)
    DRAFT,
    PROMPT,
    TARGET,
    Released,
    config,
    pair_dir,
    reference,
)
from tests.conftest import ROOT
from tests.load import within

LONG = "generate.n_predict=400"  # far more than the run reaches before the signal


class Interrupt:
    """Sends SIGINT to this process once, from whatever thread calls it."""

    def __init__(self):
        self.sent_at: float | None = None

    def __call__(self) -> None:
        if self.sent_at is None:
            self.sent_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)


def hook_phase(monkeypatch, phase: str, interrupt: Interrupt) -> Faults:
    """Interrupt in `phase`; the returned faults record the run's store (and time the I/O)."""
    layer, expand = PrunedVerify.layer, Drafter.expand

    def verify_layer(self, st, i, weights):
        if i == 2 and st.tree.pass_id == (0 if phase == "prefill" else 2):  # layer 2 is streamed
            interrupt()
        return layer(self, st, i, weights)

    def draft_expand(self, req):
        if req.cycle == 2:
            interrupt()
        return expand(self, req)

    def on_read(n, r):
        if n == 30:  # mid-decoding; the read then takes 0.3 s, in flight when the signal lands
            interrupt()

    if phase in ("prefill", "verification"):
        monkeypatch.setattr(PrunedVerify, "layer", verify_layer)
    if phase == "drafting":
        monkeypatch.setattr(Drafter, "expand", draft_expand)
    return Faults(on_read=on_read if phase == "io" else None, slow_every=31 if phase == "io" else 0)


@pytest.fixture
def sigint_default():
    """Ctrl-C as in a terminal: a job that a non-interactive shell puts in the background
    inherits SIGINT ignored, and then no signal would interrupt the run."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("phase", ["prefill", "drafting", "verification", "io"])
def test_ctrl_c_stops_lever_within_a_second_and_releases_everything(pair_dir, reference, monkeypatch, phase,  # noqa: F811
                                                                    sigint_default):
    released, interrupt = Released(), Interrupt()
    faults = hook_phase(monkeypatch, phase, interrupt)
    with inject(faults), pytest.raises(KeyboardInterrupt):
        run_pipeline(config(pair_dir / TARGET, "speculative", LONG), PROMPT)
    stop_s = time.monotonic() - interrupt.sent_at
    monkeypatch.undo()
    print(f"Ctrl-C in {phase}: stopped in {1e3 * stop_s:.1f} ms")
    assert within(stop_s, 1.0), stop_s
    if phase == "io":
        assert ("slow", 30) in [f[:2] for f in faults.fired]  # the read in flight was the slow one
    released.check(faults)


DRIVER = """
import os, signal, sys, time
from lever.backends.flash import Faults, inject
from lever.cli.main import main
sent = []
def on_read(n, r):
    if n == 30:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
with inject(Faults(on_read=on_read)):
    rc = main(sys.argv[1:])
print(f"\\nstop_s {time.monotonic() - sent[0]}")
sys.exit(rc)
"""


def test_cli_ctrl_c_mid_read_exits_130_without_a_summary(pair_dir):  # noqa: F811
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, "run", "-c", str(ROOT / "examples" / "default.toml"), "-p", PROMPT, "-n", "400",
         "--set", f'model.target="{pair_dir / TARGET}"', "--set", f'model.draft="{pair_dir / DRAFT}"',
         "--set", "flash.chunk_bytes=262144"],
        capture_output=True, text=True, timeout=120, check=False)
    stop_s = float(proc.stdout.strip().splitlines()[-1].split()[1])
    print(f"lever run, Ctrl-C mid-read: exit {proc.returncode} in {1e3 * stop_s:.1f} ms")
    assert proc.returncode == 130 and within(stop_s, 1.0), stop_s
    assert proc.stderr.strip().splitlines() == ["lever: interrupted (SIGINT)"]
