"""The suite's own machinery: a run that is cut still says what passed and failed so far, and the
quick profile sizes every generated-case count (tests/sizes.py) without dropping a property."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import settings

from tests.conftest import ROOT
from tests.sizes import QUICK, THOROUGH, cases

INNER = '''
import pathlib, time
def test_passes(): pass
def test_fails(): assert False
def test_hangs():
    pathlib.Path("{started}").touch()
    time.sleep(60)
'''
# the inner run takes the suite's own signal handling, from the suite's conftest
INNER_CONFTEST = "from tests.conftest import pytest_configure, pytest_sessionfinish  # noqa: F401\n"


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_run_cut_by_sigterm_prints_its_summary_so_far(tmp_path, workers):
    """As `timeout` or CI's limit cuts it: the two results in, the hanging test stopped, one summary."""
    started = tmp_path / "started"
    (tmp_path / "test_inner.py").write_text(INNER.format(started=started))
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, "-c", "pytest.ini", "."]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    out = b""
    # under xdist a result reaches the summary once the controller has printed it: wait for both
    deadline = time.monotonic() + 120
    while not (started.exists() and re.search(rb"(?m)^\.F", out)) and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            out += proc.stdout.read1(4096)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    text = (out + rest).decode()
    assert "1 failed, 1 passed" in text and "FAILED test_inner.py::test_fails" in text, text
    assert proc.returncode == 2, text  # pytest's "interrupted"


def test_the_quick_profile_sizes_every_count_down_and_the_thorough_one_keeps_it():
    try:
        settings.load_profile(QUICK)
        quick = [cases(n) for n in (1, 12, 40, 300)]
    finally:
        settings.load_profile(THOROUGH)
    assert quick == [2, 2, 4, 30] and [cases(n) for n in (1, 12, 40, 300)] == [1, 12, 40, 300]
