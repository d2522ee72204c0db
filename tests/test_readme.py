"""The README works as written: its two set-up commands are the ones CI runs, and every other
block marked `sh` or `python` runs here from the repository root (`sh qwen` blocks need the
Qwen2.5-Coder pair, which the `require` fixture fetches or skips with the reason)."""

import os
import re
import subprocess

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)([^\n]*)\n(.*?)\n```", README, re.S)
SETUP = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]


def test_ci_runs_the_readme_commands():
    commands = re.findall(r"```sh\n(.*?)\n```", SETUP, re.S)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert len(commands) == 2
    for cmd in commands:
        assert cmd.strip() in ci_lines, f"README command not in .ci/run: {cmd}"


def _commands(tag: str) -> list[str]:
    setup = set(re.findall(r"```sh\n(.*?)\n```", SETUP, re.S))
    return [line for lang, info, body in BLOCKS if lang == "sh" and info.strip() == tag and body not in setup
            for line in body.splitlines() if line.strip()]


def _run(line: str) -> None:
    proc = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{line}\n{proc.stderr[-2000:]}"


@pytest.mark.parametrize("line", _commands(""))
def test_readme_command_runs(line):
    _run(line)


@pytest.mark.parametrize("line", _commands("qwen"))
def test_readme_command_on_the_qwen_pair_runs(line, qwen_target, qwen_draft):
    _run(line)


def test_readme_python_block_runs(capsys):
    (code,) = [body for lang, _, body in BLOCKS if lang == "python"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(code, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert "tokens in" in capsys.readouterr().out
