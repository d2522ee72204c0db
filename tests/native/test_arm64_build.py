"""The native kernels on arm64, the phones' architecture: every source that an arm64 build
compiles (NEON paths included, x86 ones left out, as CMakeLists.txt does) compiles without
warnings and links into a shared library, with clang (the Android NDK's compiler) from the
ziglang package; and, where an arm64 CPU or qemu-aarch64 can run it, the NEON kernels equal
the scalar reference."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

NATIVE = ROOT / "native"
EM_AARCH64 = 0xB7  # ELF e_machine of arm64
# Snapdragon 8 Gen 1-3 big cores are Armv8.2+ with dotprod and fp16: what CMake asks for.
CPU = "cortex_a76"


def zig_cc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu", *args],
                          capture_output=True, text=True, timeout=600)


def test_native_builds_for_arm64(tmp_path):
    pytest.importorskip("ziglang", reason="pip install ziglang (in the [test] extra) to cross-compile for arm64")
    sources = [p for p in sorted(NATIVE.glob("*.c")) if not p.stem.endswith(("_avx2", "_avx512"))]
    assert any(p.stem.endswith("_neon") for p in sources)
    objects = []
    for src in sources:
        obj = tmp_path / (src.stem + ".o")
        proc = zig_cc("-O2", f"-mcpu={CPU}", "-DLEVER_HAVE_NEON=1", f"-I{NATIVE}", "-Wall", "-Wextra",
                      "-Wno-unused-parameter", "-Werror", "-c", str(src), "-o", str(obj))
        assert proc.returncode == 0, f"{src.name}:\n{proc.stderr}"
        objects.append(str(obj))
    lib = tmp_path / "liblever_kernels.so"
    proc = zig_cc("-shared", "-o", str(lib), *objects, "-lm", "-lpthread")
    assert proc.returncode == 0, proc.stderr
    header = lib.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64


def qemu_aarch64() -> str | None:
    """An arm64 user-mode emulator (Debian's qemu-user-static), or None; on an arm64 host the
    binary runs as it is."""
    import platform
    import shutil

    if platform.machine() in ("aarch64", "arm64"):
        return ""
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


def test_neon_kernels_equal_the_scalar_reference(tmp_path):
    """tests/native/arm64_parity.c, built with the arm64 library (static, musl) and run on arm64
    or under qemu: every matmul type in both layouts, dequantization and rmsnorm bit-identical to
    the scalar reference (which equals the numpy reference, test_matmul.py), attention and swiglu
    within test_ops.py's tolerances."""
    pytest.importorskip("ziglang", reason="pip install ziglang (in the [test] extra) to cross-compile for arm64")
    runner = qemu_aarch64()
    if runner is None:
        pytest.skip("no arm64 CPU and no qemu-aarch64 to run arm64 code (apt install qemu-user-static); "
                    "the arm64 build itself is checked by test_native_builds_for_arm64")
    sources = [str(p) for p in sorted(NATIVE.glob("*.c")) if not p.stem.endswith(("_avx2", "_avx512"))]
    exe = tmp_path / "arm64_parity"
    proc = subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl", "-static", "-O2",
                           f"-mcpu={CPU}", "-DLEVER_HAVE_NEON=1", f"-I{NATIVE}", *sources,
                           str(ROOT / "tests" / "native" / "arm64_parity.c"), "-o", str(exe), "-lm"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([runner, str(exe)] if runner else [str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
