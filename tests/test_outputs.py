"""Outputs that are lost or misnamed: every file Lever writes is checked
before the work that produces it (a missing folder, a directory, a FIFO), written under exactly
the name given, and atomically: an error or Ctrl-C leaves neither a partial file nor a temp."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from lever.cli.main import build_parser, main
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.outputs import TEMP_TAG, atomic_path, atomic_write, reap_stale, writable_destination
from lever.shipped import shipped

CFG = str(shipped("default.toml"))


def leftovers(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if TEMP_TAG in p.name]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_a_destination_is_refused_for_what_it_is(tmp_path, fifo):
    for path, needle in ((tmp_path / "no" / "x.json", "no such directory"), (tmp_path, "directory"),
                         (fifo, "FIFO"), ("/dev/null", "device"), (tmp_path / "f" / "x", "no such directory")):
        with pytest.raises(LeverError, match=needle) as e:
            writable_destination(path, "--out")
        assert str(e.value).startswith("--out ") and "\n" not in str(e.value)
    (tmp_path / "f").write_text("a file, not a folder")
    with pytest.raises(LeverError, match="cannot write|no such directory"):
        writable_destination(tmp_path / "f" / "x", "--out")
    assert writable_destination(tmp_path / "new.json", "--json") == tmp_path / "new.json"


def test_a_read_only_folder_is_refused(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root passes permission bits: ask as an unprivileged user would be answered
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == str(ro) else real(p, mode, **k))
    with pytest.raises(LeverError, match="not writable"):
        writable_destination(ro / "x", "--out")


def test_atomic_write_is_all_or_nothing(tmp_path):
    dest = tmp_path / "out.json"
    with atomic_write(dest) as f:
        f.write("first")
    assert dest.read_text() == "first" and not leftovers(tmp_path)
    for exc in (RuntimeError("disk on fire"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with atomic_write(dest) as f:
                f.write("half of the second")
                raise exc
        assert dest.read_text() == "first" and not leftovers(tmp_path)  # the old file whole, no temp
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(tmp_path / "new.bin") as tmp:
            tmp.write_bytes(b"x")
            (tmp.parent / (tmp.name + ".tmp")).write_bytes(b"a nested writer's own temp")
            raise KeyboardInterrupt
    assert not (tmp_path / "new.bin").exists() and not leftovers(tmp_path)


def test_the_output_keeps_the_umask_not_mkstemps_0600(tmp_path):
    with atomic_write(tmp_path / "o.txt") as f:
        f.write("x")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "o.txt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_stale_temps_of_dead_writers_are_reaped_and_live_ones_kept(tmp_path):
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = tmp_path / f".m.gguf.{dead}.abc123.{TEMP_TAG}"
    stale_nested = tmp_path / f".m.gguf.{dead}.def456.{TEMP_TAG}.tmp"
    live = tmp_path / f".m.gguf.{os.getppid()}.xyz789.{TEMP_TAG}"
    other = tmp_path / f".n.gguf.{dead}.abc123.{TEMP_TAG}"
    for p in (stale, stale_nested, live, other):
        p.write_bytes(b"partial")
    assert sorted(reap_stale(tmp_path / "m.gguf")) == sorted([stale, stale_nested])
    assert live.exists() and other.exists()


def test_logits_out_is_written_under_exactly_the_name_given(stories, tmp_path, capsys):
    out = tmp_path / "x"  # no .npy: np.save given this name would have written x.npy
    assert main(["logits", "-m", str(stories), "--tokens", "1,403", "--out", str(out)]) == 0
    assert f"wrote {out}:" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]
    with open(out, "rb") as f:
        assert np.load(f).shape == (2, 512)


def test_logits_refuses_ids_outside_the_vocabulary_before_computing(stories, tmp_path, capsys):
    assert main(["logits", "-m", str(stories), "--tokens", "1,512", "--out", str(tmp_path / "l.npy")]) == 1
    err = capsys.readouterr().err
    assert "--tokens: token id 512 is not in the vocabulary" in err and "0..511" in err
    assert not list(tmp_path.iterdir())


def _no_work(*a, **k):
    raise AssertionError("the work started before the destination was checked")


@pytest.mark.parametrize("argv", [
    ["run", "-p", "x", "--trace", "{missing}/t.json"],
    ["logits", "-m", "m.gguf", "--tokens", "1", "--out", "{missing}/l.npy"],
    ["profile", "-c", CFG, "--out", "{missing}/p.msgpack"],
    ["calibrate", "-c", CFG, "--corpus", str(shipped("prompts", "code.txt")), "--out", "{missing}/a.msgpack"],
    ["convert", str(shipped("models", "stdlib-draft-q8_0.gguf")), "{missing}/o.gguf"],
    ["bench", "pipelines", "-c", CFG, "--json", "{missing}/b.json"],
    ["bench", "pipelines", "-c", CFG, "--plot", "{missing}/b.png"],
    ["bench", "chat", "-c", CFG, "--json", "{missing}/c.json"],
    ["bench", "model", "-c", CFG, "--json", "{missing}/m.json"],
    ["bench", "fuzz", "--corpus", "{missing}/deeper/corpus"],
], ids=lambda a: " ".join(a[:2]))
def test_a_missing_folder_is_refused_before_any_work(argv, tmp_path, monkeypatch, capsys):
    import lever.cli.bench.pipelines
    import lever.cli.run

    monkeypatch.setattr(lever.cli.run, "run_pipeline", _no_work)
    monkeypatch.setattr(lever.cli.bench.pipelines, "run_json", _no_work)
    argv = [a.replace("{missing}", str(tmp_path / "missing")) for a in argv]
    t0 = time.monotonic()
    args = build_parser().parse_args(argv)
    with pytest.raises(LeverError, match="no such directory") as e:
        args.check(args)
    assert time.monotonic() - t0 < 1.0 and "\n" not in str(e.value)
    assert main(argv) == 1  # and the command itself stops there, in one line
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such directory" in err


def test_a_trace_is_written_whole_under_its_name(tmp_path):
    tracer = Tracer(keep_spans=True)
    with tracer.span("verify", "layer 0"):
        pass
    tracer.write_chrome(tmp_path / "t")
    assert [p.name for p in tmp_path.iterdir()] == ["t"]
    assert json.loads((tmp_path / "t").read_text())["traceEvents"]


def test_profile_and_calibrate_default_destinations_are_checked_before_measuring(tmp_path, monkeypatch, capsys):
    """Without --out they write beside the target: a read-only or missing folder there is found
    before the measurement or the calibration runs."""
    import lever.cli.profile

    monkeypatch.setattr(lever.cli.profile, "measure", _no_work)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\ntarget = "{tmp_path}/gone/t.gguf"\n')
    assert main(["profile", "-c", str(cfg)]) == 1
    assert "no such directory" in capsys.readouterr().err
