"""`lever serve`'s flags: where keys come from, bad ones refused in one line before loading, and
the warning a server open beyond loopback without a key prints."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.cli import serve
from lever.cli.main import main
from lever.errors import LeverError
from tests.serve.live import start_server, stderr_text, stop
from tests.sizes import cases


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
    (["--api-key", "has space"], "--api-key: a key is 1-256 printable ASCII characters without spaces; character 4"),
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


def one_line_refusal(argv: list[str], capsys) -> str:
    rc = main(["serve", *argv])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1, err
    return err


def test_a_key_past_ascii_is_refused_at_start_naming_where_it_came_from(tmp_path, monkeypatch, capsys):
    """A header carries bytes a server reads as Latin-1: a key past printable ASCII would never
    match what a client sends (or match one client's encoding and not another's), so it is
    refused before loading, in one line naming the flag, the variable, or the file and line."""
    f = tmp_path / "keys"
    f.write_bytes(b"# the team\nkey-a\ncaf\xe9\n")  # Latin-1, read once as U+FFFD
    err = one_line_refusal(["--api-key-file", str(f)], capsys)
    assert err.startswith(f"lever: error: {f}:3: a key is 1-256 printable ASCII") and "not UTF-8" in err
    err = one_line_refusal(["--api-key", "café"], capsys)
    assert "--api-key: a key is" in err and "character 4 is U+00E9" in err and "café" not in err  # never shown
    monkeypatch.setenv("LEVER_API_KEY", "клуч")
    err = one_line_refusal([], capsys)
    assert "$LEVER_API_KEY: a key is" in err and "character 1 is U+043A" in err


def test_key_file_lines_are_split_at_line_ends_only(tmp_path, capsys):
    """\x0b, \x1c or U+2028 inside a key is not a line end (str.splitlines would make two keys
    of it); a UTF-8 mark before the first key is an editor's, not the key's."""
    f = tmp_path / "keys"
    for bad in (b"ke\x0by", b"ke\x1cy", "ke\u2028y".encode()):
        f.write_bytes(b"\xef\xbb\xbfkey-a\r\n" + bad + b"\n")
        assert one_line_refusal(["--api-key-file", str(f)], capsys).startswith(f"lever: error: {f}:2: a key is")
    f.write_bytes(b"\xef\xbb\xbfkey-a\r\nkey-b\n")
    assert serve.access(args("--api-key-file", str(f))).api_keys == ("key-a", "key-b")


@settings(max_examples=cases(300), derandomize=True, deadline=None, database=None)
@given(key=st.text(max_size=260))
def test_a_key_is_accepted_exactly_when_it_is_1_to_256_printable_ascii(key):
    fits = 1 <= len(key) <= 256 and all("!" <= c <= "~" for c in key)
    try:
        assert serve._check_key(key, "--api-key") == key and fits
    except LeverError as e:
        assert not fits and str(e).startswith("--api-key: a key is 1-256 printable ASCII characters")


def test_lever_serve_refuses_a_latin1_key_file_and_a_non_utf8_variable_in_one_line(tmp_path):
    f = tmp_path / "keys"
    f.write_bytes(b"caf\xe9\n")
    env = {**os.environb, b"LEVER_API_KEY": b"caf\xe9"}
    for argv, environ, where in ((["--api-key-file", str(f)], None, f"{f}:1"),
                                 ([], env, "$LEVER_API_KEY")):
        p = subprocess.run([sys.executable, "-m", "lever", "serve", "--port", "1", *argv], env=environ,
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert p.returncode != 0 and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith(f"lever: error: {where}: a key is") and "not UTF-8" in p.stderr, p.stderr


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
    m = re.search(r"memory plan (\d+) MiB \(a run (\d+), its grammars (\d+) among them \+ requests (\d+) \+ kept "
                  r"conversations 64 \+ live page (\d+)\)", line)
    assert m, line
    plan, run, grammars, *parts = map(int, m.groups())
    assert abs(plan - (run + sum(parts) + 64)) <= 3 and int(m.group(5)) > 0  # each part rounded down to MiB
    assert 0 < grammars < run
    rc = main(["serve", "--cache-ram", "4096", "--set", 'memory.limit="1GiB"', "--port", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "--cache-ram: 4096 MiB of kept conversations" in err and "[memory] limit" in err


def test_a_plan_past_the_memory_the_server_can_have_is_refused(capsys):
    """No [memory] limit, but kept conversations four times the machine's memory: refused in
    one line before listening, as `lever run` refuses a plan past what it can have."""
    import psutil
    too_much_mib = 4 * psutil.virtual_memory().total >> 20
    rc = main(["serve", "--cache-ram", str(too_much_mib), "--port", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1, err
    assert f"--cache-ram: {too_much_mib} MiB" in err[0] and "available; give less" in err[0]


def test_llama_servers_flags_become_the_servers_settings():
    """--alias and --tags comma-separated (each once, in order: the id is the first), --parallel
    slots, --no-slots, --verbose; --host of several addresses."""
    s = serve.settings(args("--alias", "tinyllama-2,fim,code,fim", "--tags", "chat, small", "-np", "3", "--no-slots",
                            "-v"))
    assert (s.aliases, s.tags, s.n_slots, s.slots, s.verbose) == (("code", "fim", "tinyllama-2"), ("chat", "small"),
                                                                  3, False, True)
    plain = serve.settings(args())
    assert (plain.aliases, plain.tags, plain.n_slots, plain.slots, plain.verbose) == ((), (), 1, True, False)
    assert serve.hosts("127.0.0.1,[::1], ::1") == ["127.0.0.1", "::1", "::1"]
    assert serve.access(args("--host", "127.0.0.1,::1")).host_ok("[::1]:8080")


def test_every_address_of_host_is_listened_on_and_a_bad_one_named():
    import socket

    probe = socket.socket(socket.AF_INET6)
    try:
        probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    finally:
        probe.close()
    socks = serve.listening(["127.0.0.1", "::1"], 0)
    try:
        assert [s.family for s in socks] == [socket.AF_INET, socket.AF_INET6]
    finally:
        for s in socks:
            s.close()
    with pytest.raises(LeverError, match=r"--host no\.such\.host\.invalid: cannot listen on port 0"):
        serve.listening(["127.0.0.1", "no.such.host.invalid"], 0)
