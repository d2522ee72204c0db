"""Configs: TOML into frozen sections; every wrong key, type or value is one line naming it."""

from __future__ import annotations

import json

import pytest

from lever.config import load_config
from lever.errors import LeverError
from lever.model.sampling import LogitBias
from tests.conftest import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_and_overrides():
    c = load_config(None, ["generate.temperature=0.7", 'flash.mode="mmap"', "flash.dram_budget=0.5",
                           "channels.layers=3"])
    assert c.generate.temperature == 0.7 and c.flash.mode == "mmap" and c.flash.dram_budget == 0.5
    assert c.channels.layers == 3 and c.pipeline.kind == "flash-ar"


def test_unknown_key_names_file_section_and_key(tmp_path):
    p = write(tmp_path, "[flash]\nmod = 'direct'\n")
    with pytest.raises(LeverError, match=rf"{p}: \[flash\] unknown key 'mod'"):
        load_config(p)


def test_unknown_section(tmp_path):
    with pytest.raises(LeverError, match=r"unknown section \[flsh\]"):
        load_config(write(tmp_path, "[flsh]\nmode = 'direct'\n"))


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(LeverError, match=r"\[generate\] n_predict: expected int, got str '12'"):
        load_config(write(tmp_path, "[generate]\nn_predict = '12'\n"))


def test_bad_value_names_key(tmp_path):
    with pytest.raises(LeverError, match=r"\[flash\] mode"):
        load_config(write(tmp_path, "[flash]\nmode = 'floppy'\n"))
    with pytest.raises(LeverError, match=r"\[channels\] layers: capacity must be between 0 \(the window\) and 64"):
        load_config(None, ["channels.layers=-1"])
    with pytest.raises(LeverError, match=r"\[channels\] tokens: capacity must be between 1 and 64"):
        load_config(None, ["channels.tokens=0"])
    for bad in ("-1", "2e12"):
        with pytest.raises(LeverError, match=r"\[runtime\] what_if_read_bytes_per_s: must be in \[0, 1e12\]"):
            load_config(None, [f"runtime.what_if_read_bytes_per_s={bad}"])
    with pytest.raises(LeverError, match=r"\[pipeline\] kind: unknown pipeline 'magic'"):
        load_config(None, ['pipeline.kind="magic"'])


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(LeverError, match="not valid TOML"):
        load_config(write(tmp_path, "[flash\n"))
    with pytest.raises(LeverError, match="no such config file"):
        load_config(tmp_path / "nope.toml")


def test_bad_override_syntax():
    with pytest.raises(LeverError, match="expected section.key=value"):
        load_config(None, ["temperature=0.5"])


def test_relative_model_paths_resolve_against_the_config(tmp_path):
    c = load_config(write(tmp_path, "[model]\ntarget = 'm/t.gguf'\n"))
    assert c.model.target == str(tmp_path / "m" / "t.gguf")


def test_a_model_may_be_named_as_lever_list_names_it(tmp_path, monkeypatch):
    """examples/lever.toml names its pair so: found in $LEVER_MODELS wherever that is; a file
    beside the config still wins; a catalogue name not pulled is the file a pull would make."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "stories260K.gguf").write_bytes(b"GGUF")
    (models / "owner" / "repo").mkdir(parents=True)
    (models / "owner" / "repo" / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("LEVER_MODELS", str(models))
    c = load_config(write(tmp_path, '[model]\ntarget = "stories260k"\ndraft = "owner/repo/x.gguf"\n'))
    assert (c.model.target, c.model.draft) == (str(models / "stories260K.gguf"), str(models / "owner/repo/x.gguf"))
    (tmp_path / "stories260k").write_bytes(b"GGUF")
    beside = load_config(write(tmp_path, '[model]\ntarget = "stories260k"\n')).model.target
    assert beside == str(tmp_path / "stories260k")
    not_pulled = load_config(write(tmp_path, '[model]\ndraft = "llama-2-tiny-random"\n')).model.draft
    assert not_pulled == str(models / "llama-2-tiny-random.gguf")  # where `lever pull` puts it: the error names it
    assert load_config(write(tmp_path, '[model]\ntarget = "no-such"\n')).model.target == str(tmp_path / "no-such")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_load_and_every_line_says_why(path):
    load_config(path)
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"{path.name}: no comment on {line!r}"


# Values that are wrong for most keys of their type: each key must refuse them with one line
# naming it, or run with them to the end; never another exception, never a hang.
ABSURD = {int: [-1, 0, 10**12], float: [-1.0, 0.0, 1e12, "nan", "inf"], str: ['""', '"nonsense"'],
          tuple: ["3", "[]", '["a"]', "[0]"],
          LogitBias: ["3", "[[999999, 1.0]]", "[[0, inf]]", '[["a", 1]]', "{ 0 = nan }", "[[1, 2, 3]]", "{ 0 = -inf }"]}
SWEEP_TIMEOUT_S = 30


def _sweep_cases():
    import typing

    import attrs

    from lever.config import SECTIONS

    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in attrs.fields(cls):
            if (name, f.name) in {("model", "target"), ("model", "draft")}:
                continue
            arms = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is not tuple else (tuple,)
            for arm in arms or (hints[f.name],):
                for v in ABSURD.get(typing.get_origin(arm) or arm, []):
                    yield f"{name}.{f.name}={v}"


@pytest.mark.parametrize("item", list(_sweep_cases()))
def test_every_key_refuses_or_runs_with_an_absurd_value(item):
    import signal

    from lever.pipelines.engine import run_pipeline

    def hang(*_):
        raise TimeoutError(f"{item}: no end within {SWEEP_TIMEOUT_S} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(SWEEP_TIMEOUT_S)
    try:
        cfg = load_config(ROOT / "examples" / "default.toml",
                          ["generate.n_predict=3", "model.n_ctx=96", 'pipeline.baseline=""', item])
        run_pipeline(cfg, "def f(x):")
    except LeverError as e:
        assert "\n" not in str(e) and item.split("=")[0].split(".")[1] in str(e), str(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_every_generation_knob_reaches_every_surface_from_one_list():
    """A [generate] field is a knob of the API, the server and the commands, and reaches sampling,
    by being a field: the surfaces derive their tables from GenerateConfig (lever.config.KNOBS)."""

    import attrs

    from lever.api import llm as api
    from lever.api.call import prepare_generate
    from lever.cli.common import knob_values
    from lever.cli.main import build_parser
    from lever.config import KNOBS, GenerateConfig
    from lever.model.sampling import SamplingParams
    from lever.serve import request as serve

    # every field is a knob but the prompt, the logit bias (a table, not a number: a call's and [generate]'s)
    # and how samples are drawn (a word, the config's)
    fields = [f.name for f in attrs.fields(GenerateConfig)
              if f.name not in ("prompt", "logit_bias", "ignore_eos", "draws")]
    assert list(KNOBS) == fields
    assert {f.name for f in attrs.fields(SamplingParams)} <= {*fields, "logit_bias", "draws"}
    defaults = load_config(None).generate
    for key in fields:
        k = KNOBS[key]
        value = k.call.lo + 1 if k.call.integer else (k.call.lo + k.call.hi) / 2  # in range, not the default
        assert api.ALIASES[k.arg] == f"generate.{key}"
        gen, _, _ = prepare_generate({k.arg: value}, defaults, n_prompt=1, n_ctx=1 << 20, n_ctx_source="test")
        assert getattr(gen, key) == value
        assert serve.sampling(serve.parse(json.dumps({"prompt": "x", k.arg: value}).encode(), "completions")) == \
            {k.arg: value}
        with pytest.raises(serve.BadRequest, match=k.arg):
            serve.parse(json.dumps({"prompt": "x", k.arg: "a string"}).encode(), "completions")
        args = build_parser().parse_args(["generate", "-m", "m", "-p", "x", k.option, str(value)])
        assert knob_values(args)[key] == value
        if key in {f.name for f in attrs.fields(SamplingParams)}:
            assert getattr(GenerateConfig(**{key: value}).params(), key) == (None if key == "seed" and value == -1
                                                                           else value)
