"""The fuzzer's families besides GGUF headers (lever.fuzz.files): configs with --set
overrides, the files Lever reads back, command lines and models with non-finite values. A short
run of each finds nothing, and each family's check notices the failure it exists to find."""

from __future__ import annotations

import random

import pytest

from lever.cli.main import build_parser
from lever.fuzz import files
from lever.fuzz import runner as fuzz
from lever.fuzz.inputs import RandomChooser

N = 150  # per family here; `lever bench fuzz --n 100000` is the full run


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seeds")
    return fuzz.Sources([], artifacts=files.artifact_seeds(tmp), commands=files.commands(build_parser()),
                        paths=files.argv_paths(tmp))


def outcomes(family: str, sources, workdir, n: int = N) -> list[fuzz.Outcome]:
    ch = RandomChooser(random.Random(family))
    out = []
    for _ in range(n):
        case = fuzz.make_case(ch, sources, {family: 1})
        out += fuzz.check(case, workdir, parser_factory=build_parser)
    return out


@pytest.mark.parametrize("family", ["config", "artifact", "cli", "nonfinite"])
def test_a_short_run_of_each_family_finds_nothing_and_refuses_some(family, sources, tmp_path):
    got = outcomes(family, sources, tmp_path)
    findings = [o for o in got if o.status == "finding"]
    assert not findings, findings[:3]
    statuses = {o.status for o in got}
    assert "refused" in statuses, f"{family}: nothing refused in {N} inputs: the mutations do not bite"
    if family != "nonfinite":  # every poisoned model that reads its poison is refused
        assert "ok" in statuses, f"{family}: nothing accepted in {N} inputs: the seeds themselves are refused"


def test_the_config_check_notices_an_exception_that_is_not_a_lever_error(sources, tmp_path, monkeypatch):
    import lever.config

    monkeypatch.setattr(lever.config, "load_config", lambda path, sets: {}["x"])
    got = outcomes("config", sources, tmp_path, n=3)
    assert all(o.status == "finding" and o.signature.startswith("config: KeyError") for o in got)


def test_the_artifact_check_notices_a_value_read_back_unchecked(sources, tmp_path, monkeypatch):
    from lever.policy import profile

    seed = next(c for c in sources.artifacts if c.family == "artifact-profile")
    real = profile.read
    monkeypatch.setattr(profile, "read", lambda p: real(p).target.__class__)  # returns garbage, not a Profile
    [o] = fuzz.check(seed, tmp_path)
    assert o.status == "finding" and o.target == "artifact"


def test_the_cli_check_notices_a_command_check_that_raises(sources, tmp_path, monkeypatch):
    import lever.cli.logits as logits

    def broken(args):
        raise ValueError("unchecked")

    monkeypatch.setattr(logits, "check_args", broken)
    monkeypatch.setattr(fuzz, "_parsers", {})  # the parser is built again, with the broken check
    case = files.Case("cli", b"", "", '["logits", "-m", "x.gguf", "--tokens", "1", "--out", "o.npy"]')
    [o] = fuzz.check(case, tmp_path, parser_factory=build_parser)
    assert o.status == "finding" and "ValueError" in o.signature


def test_a_one_line_error_that_does_not_name_its_file_is_a_finding(sources, tmp_path, monkeypatch):
    from lever.errors import LeverError
    from lever.policy import profile

    def vague(p):
        raise LeverError("bad profile")

    monkeypatch.setattr(profile, "read", vague)
    seed = next(c for c in sources.artifacts if c.family == "artifact-profile")
    [o] = fuzz.check(seed, tmp_path)
    assert o.status == "finding" and "not one line naming the file" in o.signature
