"""`lever pull` end to end: the path on stdout, what happened on stderr, one-line errors; the
hub files from the stand-in hub (tests/hub/fake_hub.py), the Qwen pair found and checked where
it already is (its download is conftest's business, ~1 min, not a unit test's). The command
runs in-process (lever.cli.main.main), and once as the `python -m lever` a user runs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lever.cli.main import main
from tests.cli.test_main import assert_one_line_error
from tests.hub.fake_hub import hub  # noqa: F401

REPO = "acme/tiny-GGUF"


@pytest.fixture
def lever(capsys):
    """`lever ARGS` in this process: its exit code, stdout and stderr, as a child's would be."""
    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def test_pull_prints_the_path_and_what_it_did(hub, lever):  # noqa: F811
    data = random.Random(0).randbytes(1_500_000)
    spec = hub.add(REPO, "tiny.gguf", data)
    proc = subprocess.run([sys.executable, "-m", "lever", "pull", spec], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path == Path(os.environ["LEVER_MODELS"]) / REPO / "tiny.gguf" and path.read_bytes() == data
    assert f"{spec}: fetched, sha256 checked" in proc.stderr
    again = lever("pull", spec)
    assert again.stdout == proc.stdout and f"{spec}: present, sha256 checked" in again.stderr


def test_a_missing_file_is_one_line_naming_it(hub, lever):  # noqa: F811
    hub.add(REPO, "tiny.gguf", b"GGUF")
    assert_one_line_error(lever("pull", f"{REPO}/nope.gguf"), REPO, "no file nope.gguf", "404")
    assert_one_line_error(lever("pull", f"{REPO}/tiny.gguf", "--revision", "v9"), "no file tiny.gguf",
                          "revision v9")


def test_a_wrong_sha256_is_one_line_and_leaves_no_file(hub, lever):  # noqa: F811
    spec = hub.add(REPO, "bad.gguf", b"x" * 100_000, lie=True)
    assert_one_line_error(lever("pull", spec), "bad.gguf", "sha256", "removed")
    assert not any(p.is_file() for p in Path(os.environ["LEVER_MODELS"]).rglob("*"))


def test_a_name_that_is_neither_is_refused_before_any_network(lever, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    proc = lever("pull", "qwen9-coder")
    assert_one_line_error(proc, "'qwen9-coder'", "not a catalogue name nor OWNER/REPO/FILE", "lever list")


def test_the_qwen_pair_already_there_is_found_and_checked_by_sha256(qwen_target, qwen_draft, lever, monkeypatch):
    monkeypatch.setenv("LEVER_MODELS", str(qwen_target.parent))
    proc = lever("pull", "qwen2.5-coder")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(qwen_target), str(qwen_draft)]
    assert "qwen2.5-coder-1.5b: present, sha256 checked" in proc.stderr
    assert "qwen2.5-coder-0.5b: present, sha256 checked" in proc.stderr


def test_without_a_terminal_stderr_holds_the_lines_alone(hub, lever):  # noqa: F811
    spec = hub.add(REPO, "tiny.gguf", b"G" * 300_000)
    proc = subprocess.run([sys.executable, "-m", "lever", "pull", spec], capture_output=True, text=True, timeout=600)
    assert proc.stderr == f"{spec}: fetched, sha256 checked\n"
    proc = subprocess.run([sys.executable, "-m", "lever", "pull", f"{REPO}/nope.gguf"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 1 and proc.stderr.startswith("lever: error: ") and proc.stderr.count("\n") == 1
