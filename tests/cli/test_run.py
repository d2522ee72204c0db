"""`lever run`'s llama.cpp-style flags: -m/-md, --temp/--seed, -f FILE, -p - (stdin), and --set
paths taken from the working directory."""

from __future__ import annotations

import json
import subprocess
import sys

from lever.config import load_config
from lever.shipped import shipped
from tests.cli.test_main import assert_one_line_error
from tests.conftest import ROOT


def lever_run(*args: str, stdin: str | None = None, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lever", "run", "--json", *args], capture_output=True, text=True,
                          timeout=120, input=stdin, cwd=cwd)


def tokens(proc: subprocess.CompletedProcess) -> list[int]:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["tokens"]


def test_the_prompt_from_a_file_or_stdin_is_the_same_as_p(tmp_path):
    prompt = "def parse_args(argv):\n"
    (tmp_path / "p.txt").write_text(prompt)
    want = tokens(lever_run("-p", prompt, "-n", "12"))
    assert tokens(lever_run("-f", str(tmp_path / "p.txt"), "-n", "12")) == want
    assert tokens(lever_run("-p", "-", "-n", "12", stdin=prompt)) == want
    assert_one_line_error(lever_run("-f", str(tmp_path / "none.txt")), "none.txt", "no such file")
    assert_one_line_error(lever_run("-f", str(tmp_path)), "not a regular file")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    assert_one_line_error(lever_run("-f", str(tmp_path / "bin.txt")), "bin.txt", "UTF-8")


def test_m_and_md_name_the_models_from_the_working_directory(tmp_path):
    cfg = load_config(shipped("default.toml"))
    want = tokens(lever_run("-p", "import os", "-n", "12"))
    # relative to where the command runs, not to the config's folder
    got = lever_run("-p", "import os", "-n", "12", "-c", str(shipped("default.toml")),
                    "-m", "examples/models/" + cfg.model.target.rsplit("/", 1)[1],
                    "-md", "examples/models/" + cfg.model.draft.rsplit("/", 1)[1])
    assert tokens(got) == want
    assert_one_line_error(lever_run("-p", "x", "-m", "nope.gguf"), "nope.gguf")


def test_temp_and_seed_sample_reproducibly():
    a = tokens(lever_run("-p", "import os", "-n", "16", "--temp", "0.9", "--seed", "7"))
    assert a == tokens(lever_run("-p", "import os", "-n", "16", "--temp", "0.9", "--seed", "7"))
    assert_one_line_error(lever_run("-p", "x", "--temp", "nan"), "--temp", "finite")  # the flag, as it was typed


def test_the_summary_words_a_sampled_difference_as_sampling_allows():
    """Greedy, a difference from the baseline is a bug; sampled, losslessness holds in
    distribution and different tokens are what two runs' draws give."""
    from lever.cli.run import tokens_verdict

    assert tokens_verdict(True, 0.0, "the baseline's") == "the same tokens"
    assert "DIFFERENT" in tokens_verdict(False, 0.0, "the baseline's") and "bug" in tokens_verdict(False, 0.0, "x")
    sampled = tokens_verdict(False, 0.8, "the baseline's")
    assert "DIFFERENT" not in sampled and "as sampling allows" in sampled and sampled.startswith("sampled")


def test_the_summary_warns_when_peak_rss_passes_the_bound():
    import types

    from lever.cli.run import over_bound

    plan = types.SimpleNamespace(rss_bound_bytes=100 * 2**20)  # a plan without its own wording: figured here
    over = types.SimpleNamespace(plan=plan, peak_rss_bytes=130 * 2**20, rss_bound_bytes=100 * 2**20)
    assert "passed" in over_bound(over) and "by 30 MiB" in over_bound(over)
    assert over_bound(types.SimpleNamespace(plan=plan, peak_rss_bytes=90 * 2**20, rss_bound_bytes=100 * 2**20)) == ""


def test_a_greedy_run_that_differs_from_its_baseline_exits_non_zero():
    """Greedy output must be the target's own: a difference is a failed run, not a figure."""
    from types import SimpleNamespace

    from lever.cli.run import lossless_broken

    run = lambda equal, temp, baseline=object(): SimpleNamespace(baseline=baseline, baseline_tokens_equal=equal,  # noqa: E731
                                                                 temperature=temp)
    assert lossless_broken(run(False, 0.0))
    assert not lossless_broken(run(True, 0.0))
    assert not lossless_broken(run(False, 0.8))  # sampled: the runs draw differently
    assert not lossless_broken(run(False, 0.0, baseline=None))
