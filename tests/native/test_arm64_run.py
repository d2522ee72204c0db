"""Lever on aarch64 for real, under qemu user-mode emulation: scripts/arm64/run.sh --quick builds
the library with CMakeLists.txt's arm64 branch, runs tests/native's parity tests (scalar and NEON
against the numpy reference and each other) in an emulated aarch64 Python, compares the
bit-exact kernels' outputs with x86_64's, and runs the shipped pair's `lever run --json -n 32`
on both machines. ~2 min with the cache (~/.cache/lever/arm64, or $LEVER_ARM64_CACHE), ~3 min
when it is made (a Debian arm64 sysroot by mmdebstrap and aarch64 wheels from PyPI, ~45 s).

Skipped, with the reason, only where it cannot run: a host that is not x86_64 Linux, no
ziglang, or qemu-user-static / mmdebstrap missing without root to apt-get install them; and
when LEVER_NO_ARM64=1 (the opt-out, like LEVER_NO_FETCH)."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "arm64" / "run.sh"
CACHE = Path(os.environ.get("LEVER_ARM64_CACHE", Path.home() / ".cache" / "lever" / "arm64"))


def skip_reason() -> str | None:
    if os.environ.get("LEVER_NO_ARM64") == "1":
        return "LEVER_NO_ARM64=1"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"emulates aarch64 from an x86_64 Linux host, this is {sys.platform} {platform.machine()}"
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return "pip install ziglang (in the [test] extra) to cross-compile for arm64"
    missing = [tool for tool in ("qemu-aarch64-static", "mmdebstrap") if not shutil.which(tool)]
    if missing and (os.geteuid() != 0 or not shutil.which("apt-get")):
        return f"{' and '.join(missing)} missing and no root to apt-get install them (qemu-user-static, mmdebstrap)"
    return None


def test_lever_on_aarch64_equals_x86_64():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    for m in ("x86_64", "aarch64"):  # the script writes them anew; none left from an earlier run
        (CACHE / "out" / f"run-{m}.json").unlink(missing_ok=True)
    env = dict(os.environ, LEVER_ARM64_HOST_PYTHON=sys.executable, LEVER_ARM64_CACHE=str(CACHE))
    # waited for, not timed: under qemu the quick run takes minutes, and a loaded machine's several times that
    proc = subprocess.run(["bash", str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=3600, env=env,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "ISA aarch64 neon (cortex-a72: scalar)" in proc.stdout, out[-3000:]  # NEON only where dotprod is
    tests = re.search(r"native tests: (\d+) passed(.*)", proc.stdout)
    assert tests and int(tests.group(1)) > 300 and not re.search(r"failed|error", tests.group(2)), out[-3000:]
    assert re.search(r"fingerprint: all \d+ checks bit-identical on x86_64 .* and aarch64 \(scalar\+neon\)",
                     proc.stdout), out[-3000:]
    x86, arm = (json.loads((CACHE / "out" / f"run-{m}.json").read_text()) for m in ("x86_64", "aarch64"))
    assert len(arm["tokens"]) == 32 and arm["tokens"] == x86["tokens"]
    assert arm["text"] == x86["text"] and arm["baseline_tokens_equal"] is True
