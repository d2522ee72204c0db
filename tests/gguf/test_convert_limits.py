"""`lever convert` bounded and clean: the alignment a user may ask for is a
power of two in [32, 65536] (no gigabytes of padding); a convert stopped by an error or a signal
leaves no temp file and a killed one's is reaped by the next; every input goes through Lever's
own loader first, so what Lever refuses convert refuses, in the same line."""

from __future__ import annotations

import os
import shutil
import struct

import gguf
import numpy as np
import pytest

import lever.gguf.convert as convert_module
from lever.cli.main import build_parser
from lever.errors import LeverError
from lever.gguf.convert import MAX_ALIGNMENT, MIN_ALIGNMENT, convert
from lever.gguf.file import GGUFFile
from lever.outputs import TEMP_TAG
from tests.tiny_gguf import write_tiny_model


def temps(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if TEMP_TAG in p.name or p.name.endswith(".tmp")]


@pytest.mark.parametrize("alignment", [1 << 30, 3000, 16, 8, 0, -4096, MAX_ALIGNMENT * 2, True])
def test_alignment_outside_the_bounds_is_refused_before_reading(alignment, tmp_path):
    with pytest.raises(LeverError, match=rf"alignment must be a power of two in \[{MIN_ALIGNMENT}, {MAX_ALIGNMENT}\]"):
        convert(tmp_path / "absent.gguf", tmp_path / "out.gguf", alignment)  # the input is not even looked at
    assert not list(tmp_path.iterdir())


def test_the_cli_bounds_alignment_in_its_parser(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["convert", "a.gguf", "b.gguf", "--alignment", "1073741824"])
    assert e.value.code == 2 and "--alignment: must be an integer in [32, 65536]" in capsys.readouterr().err


def five_dimensions(path):
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("t", np.zeros((1, 1, 1, 2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def misaligned(path):
    """Two tensors, the second's data offset moved 4 bytes off the 32-byte alignment (gguf-py
    reads it; Lever's loader does not)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("ta", np.zeros(8, np.float32))
    w.add_tensor("tb", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    b = bytearray(path.read_bytes())
    i = b.index(b"tb") + 2
    at = i + 4 + 8 * struct.unpack_from("<I", b, i)[0] + 4  # n_dims, dims, type: then the offset
    struct.pack_into("<Q", b, at, struct.unpack_from("<Q", b, at)[0] + 4)
    path.write_bytes(bytes(b))
    gguf.GGUFReader(path)  # which gguf-py accepts
    return path


@pytest.mark.parametrize("make", [five_dimensions, misaligned])
def test_what_levers_loader_refuses_convert_refuses_in_the_same_line(make, tmp_path):
    src = make(tmp_path / "bad.gguf")
    with pytest.raises(LeverError) as loader:
        GGUFFile(src)
    with pytest.raises(LeverError) as converted:
        convert(src, tmp_path / "out.gguf")
    assert str(converted.value) == str(loader.value)
    assert not (tmp_path / "out.gguf").exists() and not temps(tmp_path)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError, RuntimeError])
def test_a_convert_stopped_mid_write_leaves_no_temp_and_no_output(exc, tmp_path, monkeypatch):
    src = write_tiny_model(tmp_path / "m.gguf", "llama", "F32")
    real = convert_module._write

    def write_then_fail(reader, s, dst, alignment):
        real(reader, s, dst, alignment)  # the whole temp file written, as a signal can come last
        raise exc()

    monkeypatch.setattr(convert_module, "_write", write_then_fail)
    with pytest.raises((exc, LeverError)):
        convert(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists() and not temps(tmp_path)


def test_a_killed_converts_temp_is_reaped_and_a_live_ones_kept(tmp_path):
    src = write_tiny_model(tmp_path / "m.gguf", "llama", "F32")
    dead = tmp_path / f".out.gguf.{2**22 + 4321}.abcdef.{TEMP_TAG}"  # above pid_max: no such process
    live = tmp_path / f".out.gguf.{os.getppid()}.ghijkl.{TEMP_TAG}"
    for p in (dead, live):
        p.write_bytes(b"half a model")
    convert(src, tmp_path / "out.gguf")
    assert not dead.exists() and live.exists()
    assert GGUFFile(tmp_path / "out.gguf").metadata["general.alignment"] == 4096


def test_convert_refuses_a_destination_it_cannot_write_before_reading(tmp_path, stories):
    with pytest.raises(LeverError, match="no such directory"):
        convert(stories, tmp_path / "missing" / "out.gguf")
    shutil.copyfile(stories, tmp_path / "m.gguf")
    with pytest.raises(LeverError, match="is a directory"):
        convert(tmp_path / "m.gguf", tmp_path)
