"""One validation for every command: a bad number in any command's flags is
refused before any work, in one line naming the flag, with a non-zero exit and no traceback; the
sampling bounds are the same table for the flags, the config, the API and SamplingParams."""

from __future__ import annotations

import math

import pytest

from lever.api.call import prepare_generate
from lever.cli.common import knob_values
from lever.cli.main import build_parser
from lever.config import GenerateConfig, load_config
from lever.errors import LeverError
from lever.model.sampling import LIMITS, SamplingParams
from lever.shipped import shipped
from tests.cli.test_main import assert_one_line_error, run_cli

CFG = str(shipped("default.toml"))

# Each command with the arguments it needs to parse; the flag under test is appended.
BASE = {
    "run": ["run"],
    "generate": ["generate", "-m", "m.gguf", "-p", "x"],
    "chat": ["chat"],
    "logits": ["logits", "-m", "m.gguf", "--tokens", "1", "--out", "l.npy"],
    "calibrate": ["calibrate", "-c", CFG, "--corpus", "c.txt"],
    "profile": ["profile", "-c", CFG],
    "convert": ["convert", "a.gguf", "b.gguf"],
    "serve": ["serve"],
    "bench model": ["bench", "model", "-c", CFG],
    "bench flash": ["bench", "flash", "-c", CFG],
    "bench pipelines": ["bench", "pipelines", "-c", CFG],
    "bench sources": ["bench", "sources", "-c", CFG],
    "bench chat": ["bench", "chat", "-c", CFG],
    "bench fuzz": ["bench", "fuzz"],
}

# (command, flag, bad values): every numeric flag of every command, values the issue found and
# their kin (NaN, inf, negative, past int64, not a number, past the flag's bound).
BAD = [
    ("run", "-n", ["-5", "x", "1e3", "99999999999999999999999"]),
    ("run", "--temp", ["nan", "-1", "inf", "1e9"]),
    ("run", "--seed", ["-2", "99999999999999999999999", "1.5"]),
    ("generate", "-n", ["-5", "2147483648"]),
    ("generate", "--temp", ["nan", "-0.5", "-inf"]),
    ("generate", "--seed", ["-2", str(2**63)]),
    ("generate", "--top-k", ["-1", str(2**31)]),
    ("generate", "--top-p", ["0", "1.5", "nan"]),
    ("generate", "--min-p", ["-0.1", "2"]),
    ("generate", "--repeat-penalty", ["0", "-1", "inf"]),
    ("generate", "--ctx", ["-1", str(2**21)]),
    ("generate", "--threads", ["-1", "100000"]),
    ("chat", "-n", ["0", "-3"]),
    ("chat", "--temp", ["nan"]),
    ("chat", "--seed", ["-7"]),
    ("logits", "--threads", ["-2"]),
    ("calibrate", "--n-prompts", ["0", "100000"]),
    ("calibrate", "--n-gen", ["0", "1000000"]),
    ("calibrate", "--prompt-tokens", ["-1"]),
    ("profile", "--rounds", ["0", "-1", "1000000"]),
    ("profile", "--passes", ["0"]),
    ("convert", "--alignment", ["1073741824", "3000", "16", "0", "-4096"]),
    ("serve", "--port", ["0", "65536", "-1", "http"]),
    ("serve", "--queue", ["-1", "1025"]),
    ("bench model", "--n-gen", ["0", "1000000"]),
    ("bench model", "--rounds", ["0"]),
    ("bench model", "--n-decode", ["-1"]),
    ("bench flash", "--n-gen", ["0"]),
    ("bench flash", "--cap", ["-1", "nan", "inf"]),
    ("bench pipelines", "--n-gen", ["0", "100000"]),
    ("bench sources", "--rounds", ["0", "-1", "1000000"]),
    ("bench chat", "--n-turns", ["0", "1000"]),
    ("bench chat", "--max-tokens", ["0"]),
    ("bench fuzz", "--n", ["0", "-1", "1000000000"]),
    ("bench fuzz", "--seed", ["-1"]),
    ("bench fuzz", "--timeout", ["0", "nan", "-1", "1e9"]),
]


def refusal(argv: list[str], capsys) -> str:
    """The one line parsing and checking `argv` ends with (argparse's exit 2, or a LeverError)."""
    try:
        args = build_parser().parse_args(argv)
        args.check(args)
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err.strip()
    except LeverError as e:
        err = f"lever: error: {e}"
    else:
        raise AssertionError(f"{argv}: accepted")
    assert len(err.splitlines()) == 1 and err.startswith("lever: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command, flag, values", BAD, ids=[f"{c} {f}" for c, f, _ in BAD])
def test_every_commands_bad_numbers_are_one_line_naming_the_flag(command, flag, values, capsys):
    for value in values:
        err = refusal([*BASE[command], f"{flag}={value}"], capsys)  # "=": "-inf" is then a value, not a flag
        assert f"{flag}:" in err, (value, err)


@pytest.mark.parametrize("command", list(BASE))
def test_every_command_parses_its_defaults_and_has_a_check(command):
    args = build_parser().parse_args(BASE[command])
    assert callable(args.check)


@pytest.mark.parametrize("argv, needle", [
    (["bench", "pipelines", "-c", CFG, "--budgets", "0,1.5"], "--budgets"),
    (["bench", "pipelines", "-c", CFG, "--budgets", "0,nan"], "--budgets"),
    (["bench", "pipelines", "-c", CFG, "--budgets", ""], "--budgets"),
    (["bench", "pipelines", "-c", CFG, "--chain-ks", "2,2.5"], "--chain-ks"),
    (["bench", "pipelines", "-c", CFG, "--chain-ks", "0,4"], "--chain-ks"),
    (["bench", "pipelines", "-c", CFG, "--chain-ks", "4,4"], "--chain-ks"),
    (["bench", "sources", "-c", CFG, "--variants", "model,gpt"], "--variants"),
    (["bench", "sources", "-c", CFG, "--variants", "ngram,ngram"], "--variants"),
    (["bench", "sources", "-c", CFG, "--variants", ""], "--variants"),
    (["bench", "flash", "-c", CFG, "--cap", "5"], "--cap"),  # [flash] bandwidth_cap_bytes_per_s's own floor
    (["logits", "-m", "m.gguf", "--tokens", "99999999999999999999999", "--out", "l.npy"], "--tokens"),
    (["logits", "-m", "m.gguf", "--tokens", "-1", "--out", "l.npy"], "--tokens"),
    (["logits", "-m", "m.gguf", "--tokens", ",", "--out", "l.npy"], "--tokens"),
    (["run", "--set", "generate.temperature=nan"], "--set"),
    (["run", "--set", "generate.seed=-2"], "--set"),
    (["run", "--set", "runtime.threads=-1"], "--set"),
    (["run", "--set", "model.n_ctx=0"], "--set"),
    (["run", "-p", "x", "-f", "README.md"], "-f and -p"),
    (["serve", "--host", ""], "--host"),
    (["bench", "model", "-m", "m.gguf", "-c", CFG], "-m MODEL.gguf or -c CONFIG"),
])
def test_what_two_flags_or_a_list_say_is_checked_before_any_work(argv, needle, capsys):
    assert needle in refusal(argv, capsys)


def test_good_values_at_the_bounds_are_accepted():
    p = build_parser()
    a = p.parse_args(["generate", "-m", "m", "-p", "x", "--temp", "0", "--top-p", "1", "--seed", "-1", "-n", "0",
                      "--min-p", "1", "--top-k", "0", "--ctx", "0"])
    assert GenerateConfig(**knob_values(a)).params().seed is None  # -1: a fresh seed
    assert p.parse_args(["convert", "a", "b", "--alignment", "32"]).alignment == 32
    assert p.parse_args(["convert", "a", "b", "--alignment", "65536"]).alignment == 65536
    assert p.parse_args(["serve", "--port", "65535", "--queue", "0"]).port == 65535


def toml(v) -> str:
    return "nan" if v != v else "inf" if v == math.inf else repr(v)


def _api_check(value_name: str, value):
    return prepare_generate({value_name: value}, load_config(None).generate, n_prompt=1, n_ctx=4096,
                            n_ctx_source="[model] n_ctx")


@pytest.mark.parametrize("name", list(LIMITS))
def test_config_api_sampling_and_flags_refuse_the_same_values(name):
    limit = LIMITS[name]
    bad = [limit.hi + 1, limit.lo - 1, math.nan, math.inf] if not limit.integer else [limit.hi + 1, limit.lo - 1]
    if limit.lo_open:
        bad.append(limit.lo)
    flag = {"temperature": "--temp"}.get(name, "--" + name.replace("_", "-"))
    for v in bad:
        with pytest.raises(LeverError, match=rf"\[generate\] {name}: must be"):
            load_config(None, [f"generate.{name}={toml(v)}"])
        with pytest.raises(LeverError, match=name):
            _api_check(name, v)
        if name != "seed" or v != -1:
            with pytest.raises(LeverError, match=name.replace("_", "-")):
                SamplingParams(**{name: v})
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "-m", "m", "-p", "x", flag, str(v)])
    good = limit.hi
    load_config(None, [f"generate.{name}={good!r}"])
    _api_check(name, good)


def test_the_issues_examples_end_in_one_line_from_the_shell():
    """The instances the issue names, end to end (one process each: argparse's exit, no model read)."""
    for args, flag in ((["--temp", "nan"], "--temp"), (["--seed", "-2"], "--seed"), (["-n", "-5"], "-n")):
        p = run_cli("generate", "-m", "nope.gguf", "-p", "x", "=".join(args))
        assert_one_line_error(p, flag)
        assert p.returncode == 2
    p = run_cli("logits", "-m", "nope.gguf", "--tokens", "99999999999999999999999", "--out", "/tmp/x.npy")
    assert_one_line_error(p, "--tokens")
