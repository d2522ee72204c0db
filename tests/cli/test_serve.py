"""`lever serve`'s flags: where keys come from, bad ones refused in one line before loading, and
the warning a server open beyond loopback without a key prints."""

from __future__ import annotations

import argparse
import re

import pytest

from lever.cli import serve
from lever.cli.main import main
from lever.errors import LeverError
from tests.serve.live import start_server, stderr_text, stop


def args(*argv: str):
    p = argparse.ArgumentParser()
    serve.add_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_keys_come_from_the_flag_the_file_and_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# the team\nkey-a\n\n  key-b  \n")
    monkeypatch.setenv("LEVER_API_KEY", "key-env")
    a = serve.access(args("--api-key", "key-cli", "--api-key-file", str(f), "--allowed-hosts", "Phone.local, x",
                          "--allowed-origins", "http://localhost:3000/"))
    assert a.api_keys == ("key-cli", "key-env", "key-a", "key-b")
    assert a.allowed_hosts == {"phone.local", "x"} and a.allowed_origins == {"http://localhost:3000"}


@pytest.mark.parametrize("argv, needle", [
    (["--api-key", "has space"], "--api-key: a key is 1-256 printable characters"),
    (["--api-key", ""], "--api-key: a key is"),
    (["--api-key-file", "/nonexistent/keys"], "/nonexistent/keys"),
    (["--timeout", "0"], "--timeout"),
    (["--max-connections", "0"], "--max-connections"),
])
def test_bad_flags_are_one_line_before_loading(capsys, argv, needle):
    try:
        rc = main(["serve", *argv])
    except SystemExit as e:  # argparse's own refusals (a type's bounds)
        rc = e.code
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_an_empty_key_file_is_refused(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# nobody yet\n")
    with pytest.raises(LeverError, match="no key in it"):
        serve.access(args("--api-key-file", str(f)))


def test_a_server_open_beyond_loopback_without_a_key_warns():
    proc, _ = start_server("--host", "0.0.0.0")
    stop(proc)
    assert "warning: listening on 0.0.0.0 without --api-key" in stderr_text(proc)
    proc, _ = start_server("--host", "0.0.0.0", "--api-key", "k")
    stop(proc)
    assert "warning" not in stderr_text(proc) and "1 API key" in stderr_text(proc)


def test_kept_conversations_are_in_the_plan_and_held_to_the_limit(capsys):
    proc, _ = start_server("--cache-ram", "64")
    stop(proc)
    line = next(x for x in stderr_text(proc).splitlines() if "memory plan" in x)
    m = re.search(r"memory plan (\d+) MiB \(a run (\d+), its grammars (\d+) among them \+ bodies (\d+) \+ kept "
                  r"conversations 64 \+ live page (\d+)\)", line)
    assert m, line
    plan, run, grammars, *parts = map(int, m.groups())
    assert abs(plan - (run + sum(parts) + 64)) <= 3 and int(m.group(5)) > 0  # each part rounded down to MiB
    assert 0 < grammars < run
    rc = main(["serve", "--cache-ram", "4096", "--set", 'memory.limit="1GiB"', "--port", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "--cache-ram: 4096 MiB of kept conversations" in err and "[memory] limit" in err
