"""examples/structured_calls.py: five calls of each greedy structured request give one text,
valid under its schema or cut by its length, on the shipped pair and on a SentencePiece model."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("args", [[], ["--spm"]])
def test_five_calls_give_one_text_each(stories, args):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "structured_calls.py"), *args], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6 and all(" 1 text " in ln and ("valid" in ln or "length" in ln) for ln in lines), lines
    assert any("valid" in ln for ln in lines)
