"""Inputs that are not what they claim: a FIFO, a directory or a
device where a model, config, prompt or session file goes; a binary file as a config; a --set
that smuggles a second key or leaves a quote open. One line naming the file or the --set, a
non-zero exit, and never a hang."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lever.config import load_config
from lever.errors import LeverError
from lever.shipped import shipped
from tests.cli.test_main import assert_one_line_error
from tests.conftest import ROOT


def lever(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lever", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_a_fifo_anywhere_a_file_goes_is_refused_without_opening_it(fifo):
    assert_one_line_error(lever("run", "-c", str(fifo)), str(fifo), "FIFO")
    assert_one_line_error(lever("inspect", str(fifo)), str(fifo), "FIFO")
    assert_one_line_error(lever("run", "-m", str(fifo), "-p", "x"), str(fifo), "FIFO")
    assert_one_line_error(lever("run", "-f", str(fifo)), str(fifo), "FIFO")
    assert_one_line_error(lever("bench", "pipelines", "-c", str(shipped("default.toml")), "--prompts", str(fifo)),
                          str(fifo), "FIFO")
    assert_one_line_error(lever("run", "--set", f'profile.path="{fifo}"', "-p", "x", "-n", "2"), str(fifo), "FIFO")


def test_devices_and_directories_are_named_for_what_they_are(tmp_path):
    assert_one_line_error(lever("inspect", "/dev/null"), "/dev/null", "device")
    assert_one_line_error(lever("run", "-c", "/dev/zero"), "/dev/zero", "device")  # would read forever
    assert_one_line_error(lever("run", "-c", str(tmp_path)), str(tmp_path), "directory")


def test_a_gguf_given_as_the_config_names_the_byte_that_is_not_text():
    gguf = shipped("models", "stdlib-draft-q8_0.gguf")
    p = lever("run", "-c", str(gguf))
    assert_one_line_error(p, str(gguf), "not UTF-8 text", "byte")


@pytest.mark.parametrize("item, needle", [
    ('generate.top_k=1\nmodel.target="nope"', "one line"),
    ('generate.prompt="abc', "not a TOML value"),
    ("generate.prompt='abc", "not a TOML value"),
    ("generate.top_k=[1, 2", "not a TOML value"),
    ('generate.top_k="x"', "top_k"),
    ("nosection.key=1", "unknown section"),
    ("generate.nokey=1", "nokey"),
    ("generate.top_k=-1", "top_k"),
])
def test_an_override_is_exactly_one_value_and_its_error_names_set(item, needle):
    with pytest.raises(LeverError, match="--set") as e:
        load_config(shipped("default.toml"), [item])
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert str(shipped("default.toml")) not in str(e.value)  # the file did nothing wrong
    assert_one_line_error(lever("run", "-p", "x", "--set", item), "--set")


def test_bare_words_are_still_strings():
    assert load_config(None, ["generate.prompt=hello world", "model.target=m.gguf"]).generate.prompt == "hello world"
