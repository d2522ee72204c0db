"""The README's two set-up commands are the ones CI runs."""

import re

from tests.conftest import ROOT


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", section, re.S)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert len(commands) == 2
    for cmd in commands:
        assert cmd.strip() in ci_lines, f"README command not in .ci/run: {cmd}"
