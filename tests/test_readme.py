"""The README works as written: its two set-up commands are the ones CI runs, every other block
marked `sh` or `python` (in the README and in docs/) runs here from the repository root (`sh qwen`
blocks need the Qwen2.5-Coder pair, which the `require` fixture fetches or skips with the reason;
`sh measure` blocks are benchmarks of minutes to an hour, run by hand), and its picture of the
pipeline is the graph the code builds."""

import os
import re
import subprocess

import pytest

from tests.conftest import ROOT, SHARED

README = (ROOT / "README.md").read_text()
DOCS = [README] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [b for text in DOCS for b in re.findall(r"```(\w+)([^\n]*)\n(.*?)\n```", text, re.S)]
SETUP = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]


def test_ci_runs_the_readme_commands():
    """Each part of the README's two commands is one timed step of .ci/run, in the same order."""
    commands = re.findall(r"```sh\n(.*?)\n```", SETUP, re.S)
    assert len(commands) == 2
    parts = [part.strip() for cmd in commands for part in cmd.strip().split("&&")]
    steps = re.findall(r'^timed (?:"[^"]+"|\S+) (.+)$', (ROOT / ".ci" / "run").read_text(), re.M)
    assert steps == parts


def _commands(tag: str) -> list[str]:
    setup = set(re.findall(r"```sh\n(.*?)\n```", SETUP, re.S))
    return [line for lang, info, body in BLOCKS if lang == "sh" and info.strip() == tag and body not in setup
            for line in body.splitlines() if line.strip()]


def _run(line: str) -> None:
    if "../shared/" in line and not SHARED.exists():  # the tools beside the project, as the README says
        pytest.skip(f"{SHARED} absent: this clone does not sit beside ../shared")
    proc = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{line}\n{proc.stderr[-2000:]}"


@pytest.mark.parametrize("line", _commands(""))
def test_readme_command_runs(line):
    _run(line)


@pytest.mark.parametrize("line", _commands("qwen"))
def test_readme_command_on_the_qwen_pair_runs(line, qwen_target, qwen_draft):
    _run(line)


PYTHON = [body for lang, _, body in re.findall(r"```(\w+)([^\n]*)\n(.*?)\n```", README, re.S) if lang == "python"]


@pytest.mark.parametrize("code", PYTHON, ids=[f"block{i}" for i in range(len(PYTHON))])
def test_readme_python_block_runs(code, capsys):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(code, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().out.strip()  # each block prints what it made


def test_readme_has_the_api_the_memory_and_the_composition_blocks():
    assert len(PYTHON) == 3 and "lever.load" in PYTHON[0] and "set_memory" in PYTHON[1] and "compose(" in PYTHON[2]


def test_readme_pipeline_picture_is_the_graph_compose_builds():
    from lever.config import load_config
    from lever.model.transformer import Model
    from lever.pipelines.compose import Request, compose
    from lever.pipelines.plan import RunPlan
    from lever.pipelines.target import FlashTarget

    plan = RunPlan.resolve(load_config(ROOT / "examples" / "default.toml"))
    target = FlashTarget.open(plan.target_file.path, plan.flash, resident=plan.resident)
    try:
        c = compose(target, Model(file=plan.draft_file), plan, Request([1]))
    finally:
        target.close()
    (picture,) = [body for lang, _, body in BLOCKS if lang == "mermaid"]
    assert picture == c.pipeline.to_mermaid(), "README's pipeline picture is stale; paste:\n" + c.pipeline.to_mermaid()
