#!/usr/bin/env bash
# Lever on aarch64 (the phones' architecture) under qemu user-mode emulation, from an x86_64
# Debian/Ubuntu host: the native parity tests and the shipped pair's greedy run, against x86_64.
#
#   scripts/arm64/run.sh [--quick] [--setup-only]
#
# 1. tools: qemu-aarch64-static (Debian's qemu-user-static) and mmdebstrap, apt-get installed
#    when missing (needs root); ziglang (the [test] extra) for the cross compiler.
# 2. sysroot: Debian bookworm's arm64 python3.11 and the C/C++ runtime, extracted by mmdebstrap
#    --variant=extract (no emulated maintainer scripts, no binfmt_misc needed): ~75 MB, ~10 s.
# 3. wheels: pyproject.toml's dependencies plus pytest and hypothesis (tests/conftest.py sizes the suite with it) as manylinux aarch64 cp311 wheels from
#    PyPI, pip installed with --target into the cache: ~25 MB, ~20 s.
# 4. native: CMakeLists.txt cross-built for aarch64 (toolchain.cmake, zig-cc), so its arm64
#    branch (NEON sources, -march=armv8.2-a+dotprod+fp16, LEVER_HAVE_NEON) is the one used.
# 5. under qemu-aarch64 -cpu cortex-a76 (a phone big core: Armv8.2 + dotprod + fp16), with
#    the repository's code as it is (sitecustomize.py lays the packages out, nothing installed):
#    the ISA the library picks (must be neon); tests/native/test_matmul.py, test_ops.py and
#    test_quants.py, which compare every ISA the CPU runs (scalar and neon) with the numpy
#    reference and with each other; fingerprint.py, the bit-exact kernels' outputs hashed on
#    both machines and compared; `lever run --json -n 32` on the shipped pair on both
#    machines, token ids compared.
#
# --quick leaves out the tests on the real Qwen draft's tensors (gguf-py parsing a 0.5B model
# takes ~75 s under emulation; random tensors of every type still run): what CI runs
# (tests/native/test_arm64_run.py). --setup-only stops after step 4.
# Time: first run ~1 min of set-up (apt, mmdebstrap, pip), then ~3 min (--quick ~1.5 min) on
# 2 cores; later runs reuse the cache and take the test time alone. Idempotent: each step
# checks its stamp in the cache and redoes only what changed.
# Cache: $LEVER_ARM64_CACHE, default ~/.cache/lever/arm64 (outside the repository).
# Host Python (the one with lever installed, for the x86_64 side and ziglang):
# $LEVER_ARM64_HOST_PYTHON, default python3. Exit status 0 only when everything matched.
set -euo pipefail

QUICK=0
SETUP_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --setup-only) SETUP_ONLY=1 ;;
    -h|--help) sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${LEVER_ARM64_CACHE:-$HOME/.cache/lever/arm64}"
HOST_PY="${LEVER_ARM64_HOST_PYTHON:-python3}"
HOST_PY="$(command -v "$HOST_PY")"
SUITE=bookworm              # its python3.11 matches the wheels' --python-version
CPU=cortex-a76
DEBS="python3.11 libstdc++6 libgcc-s1"
PLATFORMS=(--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64
           --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all:)
mkdir -p "$CACHE"
T0=$SECONDS

step() { printf '\n==> %s\n' "$*"; }
run() { printf '    $ %s\n' "$*" >&2; "$@"; }
took() { printf '    (%ds)\n' "$((SECONDS - $1))"; }

step "tools (host $(uname -m), cache $CACHE)"
t=$SECONDS
missing=()
command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "run.sh: missing ${missing[*]}: run as root or apt-get install ${missing[*]}" >&2; exit 1
  fi
  run apt-get update -qq
  DEBIAN_FRONTEND=noninteractive run apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! "$HOST_PY" -c "import ziglang" 2>/dev/null; then
  run "$HOST_PY" -m pip install -q "ziglang>=0.13"
fi
echo "    qemu: $(qemu-aarch64-static --version | head -1)"
took $t

step "sysroot: Debian $SUITE arm64 ($DEBS)"
t=$SECONDS
SYSROOT="$CACHE/sysroot"
want="$SUITE $DEBS"
if [ "$(cat "$CACHE/sysroot.stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$SYSROOT" "$SYSROOT.new" "$CACHE/sysroot.stamp"
  run mmdebstrap --quiet --variant=extract --architectures=arm64 --include="${DEBS// /,}" \
    "$SUITE" "$SYSROOT.new"
  # qemu -L looks a path up in the sysroot first: without these, /tmp, /proc and /sys are the host's.
  rm -rf "$SYSROOT.new/tmp" "$SYSROOT.new/proc" "$SYSROOT.new/sys"
  mv "$SYSROOT.new" "$SYSROOT"
  echo "$want" > "$CACHE/sysroot.stamp"
else
  echo "    cached ($(du -sh "$SYSROOT" | cut -f1))"
fi
PY_ARM=(qemu-aarch64-static -cpu "$CPU" -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11")
took $t

step "wheels: manylinux aarch64 cp311 from PyPI"
t=$SECONDS
mapfile -t REQS < <("$HOST_PY" -c "
import tomllib
p = tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']
print('\n'.join(p['dependencies'] + ['pytest>=8', 'pytest-asyncio>=0.23', 'hypothesis>=6']))")
want="${PLATFORMS[*]} ${REQS[*]}"
if [ "$(cat "$CACHE/site.stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$CACHE/site" "$CACHE/site.new" "$CACHE/site.stamp"
  run "$HOST_PY" -m pip download -q --disable-pip-version-check -d "$CACHE/wheels" "${PLATFORMS[@]}" "${REQS[@]}" \
    2> >(grep -v "^WARNING: Location" >&2)
  run "$HOST_PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$CACHE/wheels" \
    --target "$CACHE/site.new" "${PLATFORMS[@]}" "${REQS[@]}" 2> >(grep -v "^WARNING: Location\|as the 'root' user" >&2)
  mv "$CACHE/site.new" "$CACHE/site"
  echo "$want" > "$CACHE/site.stamp"
else
  echo "    cached: ${REQS[*]}"
fi
took $t

step "native: CMakeLists.txt cross-built for aarch64 (zig cc)"
t=$SECONDS
export LEVER_ARM64_HOST_PYTHON="$HOST_PY"
BUILD="$CACHE/build"
command -v cmake >/dev/null || run "$HOST_PY" -m pip install -q cmake ninja
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  run nice -n 10 cmake -S "$ROOT" -B "$BUILD" "${gen[@]}" -DCMAKE_TOOLCHAIN_FILE="$HERE/toolchain.cmake" \
    > "$CACHE/cmake.log" || { cat "$CACHE/cmake.log"; exit 1; }
fi
run nice -n 10 cmake --build "$BUILD" > "$CACHE/build.log" || { cat "$CACHE/build.log"; exit 1; }
PKG="$CACHE/pkg"
mkdir -p "$PKG"
cp "$BUILD/liblever_kernels.so" "$PKG/"
ln -sfn "$ROOT/stages" "$PKG/stages"
ln -sfn "$ROOT/backends" "$PKG/backends"
command -v file >/dev/null && echo "    $(file -b "$PKG/liblever_kernels.so" | cut -d, -f1-2)"
took $t
[ "$SETUP_ONLY" = 1 ] && { echo; echo "arm64: set-up done in $((SECONDS - T0))s"; exit 0; }

# The emulated Python sees the repository's code as it is: lever/ from the repository,
# lever.stages / lever.backends and the aarch64 library through sitecustomize.py.
export PYTHONPATH="$ROOT:$HERE:$CACHE/site"
export LEVER_ARM64_PKG="$PKG" LEVER_NATIVE_LIB="$PKG/liblever_kernels.so"
export PYTHONPYCACHEPREFIX="$CACHE/pycache"
unset PYTHONHOME
arm() { nice -n 10 "${PY_ARM[@]}" "$@"; }
host() { env -u PYTHONPATH -u LEVER_ARM64_PKG -u LEVER_NATIVE_LIB -u PYTHONPYCACHEPREFIX "$HOST_PY" "$@"; }
OUT="$CACHE/out"
mkdir -p "$OUT"
cd "$ROOT"
fail=0

step "ISA under qemu-aarch64 -cpu $CPU"
isa=$(arm -c "import platform; from lever.backends.cpu import native as n; print(platform.machine(), n.best_isa())")
echo "    $isa"
[ "$isa" = "aarch64 neon" ] || { echo "    FAIL: expected aarch64 neon"; fail=1; }

step "ISA under qemu-aarch64 -cpu cortex-a72 (Armv8.0: no dotprod, no fp16 arithmetic)"
old_isa=$(nice -n 10 qemu-aarch64-static -cpu cortex-a72 -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" -c \
  "from lever.backends.cpu import native as n; import numpy as np; print(n.best_isa())")
echo "    $old_isa"
[ "$old_isa" = "scalar" ] || { echo "    FAIL: expected scalar on a core without dotprod"; fail=1; }

step "native parity tests under emulation"
t=$SECONDS
# numpy's own float16 -> float32 cast on aarch64 quiets signaling NaNs (the hardware FCVT does),
# so that one case's reference differs there; Lever's widening of all 65,536 F16 patterns is
# checked bit for bit against x86_64's by fingerprint.py below instead.
args=(-q -p no:cacheprovider -o addopts="" -ra -o asyncio_default_fixture_loop_scope=function
      --deselect "tests/native/test_quants.py::test_every_16_bit_pattern_widens_exactly[F16]")
[ "$QUICK" = 1 ] && args+=(-k "not real_tensors")
set +e
run arm -m pytest "${args[@]}" tests/native/test_matmul.py tests/native/test_ops.py tests/native/test_quants.py \
  > "$OUT/pytest.log" 2>&1
rc=$?
set -e
{ grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" || true; } | head -20 | sed 's/^/    /'
tests_line=$(tail -1 "$OUT/pytest.log" | tr -d '=' | sed 's/^ *//; s/ *$//')
echo "    $tests_line"
[ $rc = 0 ] || { echo "    FAIL (log: $OUT/pytest.log)"; fail=1; }
took $t

step "fingerprint: bit-exact kernels, x86_64 vs aarch64"
t=$SECONDS
run host scripts/arm64/fingerprint.py "$OUT/fingerprint-x86_64.json" | sed 's/^/    /'
run arm scripts/arm64/fingerprint.py "$OUT/fingerprint-aarch64.json" | sed 's/^/    /'
fp_line=$(host scripts/arm64/fingerprint.py --compare "$OUT/fingerprint-x86_64.json" "$OUT/fingerprint-aarch64.json") \
  || fail=1
echo "$fp_line" | sed 's/^/    /'
fp_line=$(echo "$fp_line" | tail -1)
took $t

step "lever run --json -n 32 (examples/default.toml, the shipped pair), x86_64 vs aarch64"
t=$SECONDS
run host -m lever run --json -n 32 > "$OUT/run-x86_64.json"
run arm -m lever run --json -n 32 > "$OUT/run-aarch64.json"
run_line=$(host - "$OUT/run-x86_64.json" "$OUT/run-aarch64.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
same = a["tokens"] == b["tokens"]
print("    aarch64 text:", repr(b["text"]))
print("    aarch64 tokens:", b["tokens"])
print("    aarch64 equal to its own autoregressive baseline:", b.get("baseline_tokens_equal"))
print(f"lever run: {len(b['tokens'])} aarch64 tokens {'equal to' if same else 'DIFFERENT from'} "
      f"x86_64's {len(a['tokens'])} ({b['pipeline']}, {b['decode_tps']:.1f} tok/s emulated, "
      f"{a['decode_tps']:.1f} native)")
sys.exit(0 if same and b.get("baseline_tokens_equal") is not False else 1)
EOF
) || fail=1
echo "$run_line" | sed 's/^lever run:/    lever run:/'
run_line=$(echo "$run_line" | tail -1)
took $t

echo
echo "arm64: ISA $isa (cortex-a72: $old_isa); native tests: $tests_line"
echo "arm64: $fp_line"
echo "arm64: $run_line"
echo "arm64: $([ $fail = 0 ] && echo ok || echo FAILED) in $((SECONDS - T0))s"
exit $fail
