"""examples/serve_cases.py against this checkout's `lever serve`: every case answered as issue 34
asks (the script is how the before/after table in docs/measurements.md was made)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT
from tests.load import within


def test_every_case_gets_the_answer_it_should():
    p = subprocess.run([sys.executable, "examples/serve_cases.py", sys.executable, "-m", "lever"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    got = dict(line.rsplit(": ", 1) for line in p.stdout.strip().splitlines())
    big = got["3.5 MB prompt: status, time; worst /health"]  # "400 after 0.31 s; 12 ms"
    status, took = big.split(" after ")
    assert status == "400" and within(float(took.split(" s")[0]), 1.0), big
    assert got["declared 500 MB body"] == "HTTP/1.1 413 Request Entity Too Large"
    for case, want in (("JSON nested 50,000 deep", "400"), ("404", "404"), ("echo: true", "400"),
                       ("text/plain POST (a cross-site form)", "415"), ("a rebound Host", "421"),
                       ("a template raising TypeError", "400")):
        assert got[case] == f"{want} application/json", case
    forged, near = got["<|endoftext|> inside a message: prompt tokens (a near-miss text's)"].strip(")").split(" (")
    assert int(forged) > int(near)  # the special-token text was tokenized as text (longer), not one control token
    assert got["tracebacks after 3 clients left the queue"] == "0"
    assert got["SIGTERM during an endless render"].startswith("exit 143") and got["that chat's client got"] == "503"
