"""examples/llama_server_suite.py: llama.cpp's own server test suite, unchanged, against `lever serve`.

    python examples/llama_server_suite.py                      # every file, one pytest run each
    python examples/llama_server_suite.py --files basic,completion --failures --json out.json

The suite (llama.cpp's tools/server/tests: unit/*.py, utils.py, conftest.py) is found at
--suite, $LLAMA_SERVER_TESTS, or the llama.cpp tree beside this checkout. Its utils start
`$LLAMA_SERVER_BIN_PATH` with llama-server's flags: that is examples/llama_server_shim.py, which
runs `lever serve` instead. pytest runs in the suite's folder with examples/llama_server_plugin.py
(`-p`), which skips what does not apply to a one-model speculative server, each with its reason.
Files run one by one (a hang costs one file, capped by --file-timeout), each test phase bounded
by --test-timeout, `-m "not slow"` as the suite's tests.sh does, results read from JUnit XML.

It prints a table per file (passed / failed / skipped, the skip reasons), the totals, and the
ratio passed / (passed + failed) over the tests that apply; --failures adds each failed test's
first error line grouped by cause (route 404s by path, missing fields by name, ...), what to
build next; --json F writes it all (every failure with its cause); --reread --work DIR reports a
previous run's XML again. Exit status 0 whatever the results (it measures), 2 when the suite
cannot run (a module it needs is absent: `pip install wget` is the usual one).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHIM = HERE / "llama_server_shim.py"
SUITE_IN_TREE = Path("src/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests")
SUITE_NEEDS = ("requests", "wget", "openai", "filelock", "pytest")  # its requirements.txt, as far as unit/ imports


def find_suite(given: str | None) -> Path:
    candidates = [Path(given)] if given else \
        [Path(os.environ["LLAMA_SERVER_TESTS"])] if os.environ.get("LLAMA_SERVER_TESTS") else \
        [ROOT.parent / "llama.cpp" / SUITE_IN_TREE, ROOT.parent / "ref" / SUITE_IN_TREE.relative_to("src")]
    for c in candidates:
        if (c / "utils.py").is_file() and (c / "unit").is_dir():
            return c.resolve()
    sys.exit(f"llama.cpp's server tests not found in {', '.join(map(str, candidates))} (--suite DIR)")


def check_modules():
    absent = [m for m in SUITE_NEEDS if importlib.util.find_spec(m) is None]
    if absent:
        print(f"the suite needs {' '.join(absent)}: pip install {' '.join(absent)} "
              "(its requirements.txt)", file=sys.stderr)
        sys.exit(2)


def serve_flags() -> str:
    """Asked once: the shim passes on unchanged the flags lever serve lists."""
    text = subprocess.run([sys.executable, "-m", "lever", "serve", "--help"], capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout
    return ",".join(sorted(set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def suite_env(work: Path, test_timeout: float) -> dict[str, str]:
    os.chmod(SHIM, os.stat(SHIM).st_mode | 0o111)  # a fresh checkout may have lost the executable bit
    return {**os.environ, "LLAMA_SERVER_BIN_PATH": str(SHIM), "LEVER_SERVE_FLAGS": serve_flags(),
            "PORT": str(free_port()),  # not 8080: other servers share this machine
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
            "LLAMA_SUITE_MISSING": str(work / "missing.txt"), "LLAMA_SUITE_TEST_TIMEOUT": str(test_timeout),
            "LLAMA_CACHE": str(work / "cache")}


def pytest_command(file: str, xml: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", f"unit/{file}", "-p", "no:cacheprovider", "-p", "llama_server_plugin",
            "-m", "not slow", "-o", "junit_logging=all", f"--junitxml={xml}", "-q"]


def run_file(file: str, *, suite: Path, env: dict[str, str], work: Path, cap: float) -> dict:
    """One file's pytest, in its own process group: past `cap` seconds the group (servers too) goes."""
    xml, log = work / f"{file}.xml", work / f"{file}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(pytest_command(file, xml), cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=cap)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    result = read_junit(xml) if xml.exists() else {"passed": 0, "failed": 0, "skipped": 0, "skips": {}, "failures": []}
    result.update(seconds=round(time.monotonic() - start, 1), timed_out=timed_out, log=str(log))
    if not xml.exists() and not timed_out:
        result["failures"].append({"test": file, "line": log.read_text()[-300:].strip(), "cause": "pytest crashed"})
        result["failed"] += 1
    return result


def error_lines(bad: ET.Element) -> list[str]:
    """A failure's "E" lines (pytest's own account of it), else its message."""
    lines = [line[1:].strip() for line in (bad.text or "").splitlines() if line.startswith("E ")]
    return [line for line in lines if line] or (bad.get("message") or bad.text or bad.tag).strip().splitlines()


def read_junit(xml: Path) -> dict:
    out = {"passed": 0, "failed": 0, "skipped": 0, "skips": collections.Counter(), "failures": []}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            props["404"] = [p.get("value") for p in case.iter("property") if p.get("name") == "404"]
            statements = [line[1:].strip() for line in (bad.text or "").splitlines() if line.startswith(">")]
            props["statement"] = statements[-1] if statements else ""
            lines = error_lines(bad) or [bad.tag]
            out["failed"] += 1
            out["failures"].append({"test": case.get("name"), "line": lines[0],
                                    "cause": cause("\n".join(lines), props, case.findtext("system-out") or "")})
        elif skip is not None:
            out["skipped"] += 1
            out["skips"][(skip.get("message") or "").removeprefix("not for Lever: ")] += 1
        else:
            out["passed"] += 1
    out["skips"] = dict(out["skips"])
    return out


STATUS = r"assert ([1-5]\d\d) == ([1-5]\d\d)|Server returned error: ([1-5]\d\d)|Expected [1-5]\d\d, got ([1-5]\d\d)"
CAUSES = (  # (pattern in the failure's E lines, the cause it names); the first that matches wins
    (r"Server process died with return code (\d+)", "lever serve exited at start ({0})"),
    (r"Server did not start within", "lever serve not ready within the suite's 60 s"),
    (r"PhaseTimeout", "test phase timed out"),
    (r"no such route: (/[^\s'\",}]*)", "route 404: {0}"),
    (r"no chat template", "no chat template: the GGUF has none (any route that renders messages)"),
    (r"match_regex", "content regex (the text differs from llama-server's)"),
    (r"KeyError: '([^']+)'", "field missing: {0}"),
    (r"assert '([\w./-]+)' in ", "field missing: {0}"),
    (r"Expected (non empty content delta|finish_reason in chunk)", "streaming: {0}"),
    (r"(\w+Error): Error code: (\d+) - (.{0,70})", "openai client: {0} {1}: {2}"),
    (r"ServerError: \((\d+), .*?'message': ['\"](.{0,70})", "stream refused: HTTP {0}: {1}"),
    (STATUS, "HTTP"),
)


def said(text: str) -> str:
    return re.sub(r"\d+", "N", text)[:80]


def cause(text: str, props: dict, stdout: str) -> str:
    said_last = props.get("last_error") or ""  # what the server said to the test's last request
    for pattern, label in CAUSES:
        m = re.search(pattern, f"{text}\n{said_last}")
        if not m:
            continue
        if label == "HTTP":
            if "status" not in props["statement"]:  # "assert 128 == 248" counts tokens, not an HTTP status
                continue
            got = next(g for g in m.groups() if g)
            where = props.get("last_request", "?").split(" -> ")[0]
            if got == "404" and props["404"]:
                return f"route 404: {props['404'][0].split(' ')[-1]}"
            return f"HTTP {got} on {where}" + (f": {said(said_last)}" if said_last else "")
        if label.startswith("lever serve exited"):
            errors = [s.strip() for s in stdout.splitlines() if "error" in s.lower() and "Captured" not in s]
            return label.format(*m.groups()) + (f": {errors[-1]}" if errors else "")
        return label.format(*m.groups())
    if props["statement"]:  # "assert False" says less than the statement that failed
        return said(f"failed: {props['statement']}")
    return said(re.sub(r"'[^']*'?", "'…'", text.splitlines()[0]))  # quoted texts vary by test, not by cause


def print_table(results: dict[str, dict]) -> dict:
    print(f"{'file':<30} {'passed':>6} {'failed':>6} {'skipped':>7} {'s':>6}  skipped because")
    totals = collections.Counter()
    for file, r in results.items():
        reasons = "; ".join(f"{n}x {why}" if n > 1 else why for why, n in r["skips"].items())
        note = "  TIMED OUT (the file's cap)" if r["timed_out"] else ""
        print(f"{file:<30} {r['passed']:>6} {r['failed']:>6} {r['skipped']:>7} {r['seconds']:>6.0f}  {reasons}{note}")
        totals.update(passed=r["passed"], failed=r["failed"], skipped=r["skipped"])
    applied = totals["passed"] + totals["failed"]
    ratio = totals["passed"] / applied if applied else 0.0
    print(f"{'total':<30} {totals['passed']:>6} {totals['failed']:>6} {totals['skipped']:>7}")
    print(f"passed / (passed + failed) = {totals['passed']} / {applied} = {ratio:.1%}")
    return {**totals, "ratio": round(ratio, 4)}


def print_failures(results: dict[str, dict]):
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for file, r in results.items():
        for f in r["failures"]:
            groups[f["cause"]].append(f"{file.removeprefix('test_').removesuffix('.py')}::{f['test']}: {f['line']}")
    print(f"\nfailures by cause ({sum(map(len, groups.values()))}):")
    for what, tests in sorted(groups.items(), key=lambda g: -len(g[1])):
        print(f"{len(tests):>4}  {what}")
        for t in tests[:3]:
            print(f"        {t[:160]}")
        if len(tests) > 3:
            print(f"        ... {len(tests) - 3} more")


def pick_files(suite: Path, wanted: str | None) -> list[str]:
    every = sorted(p.name for p in (suite / "unit").glob("test_*.py"))
    if not wanted:
        return every
    names = [w if w.startswith("test_") else f"test_{w}" for w in wanted.split(",")]
    names = [n if n.endswith(".py") else f"{n}.py" for n in names]
    unknown = [n for n in names if n not in every]
    if unknown:
        sys.exit(f"no such file in {suite / 'unit'}: {', '.join(unknown)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", help="llama.cpp's tools/server/tests (default: found beside this checkout)")
    p.add_argument("--files", help="some files only: basic,completion or test_basic.py,...")
    p.add_argument("--json", metavar="F", help="write the table, totals and failures as JSON")
    p.add_argument("--failures", action="store_true", help="each failed test's first error line, by cause")
    p.add_argument("--file-timeout", type=float, default=600, help="seconds one file may take (default 600)")
    p.add_argument("--test-timeout", type=float, default=180, help="seconds one test phase may take (default 180)")
    p.add_argument("--work", help="folder for the JUnit XML and logs (default: a fresh temporary one)")
    p.add_argument("--reread", action="store_true", help="run nothing: report the XML a run left in --work")
    return p.parse_args(argv)


def run_files(files: list[str], *, suite: Path, work: Path, args: argparse.Namespace) -> dict[str, dict]:
    env = suite_env(work, args.test_timeout)
    results = {}
    for file in files:
        results[file] = r = run_file(file, suite=suite, env=env, work=work, cap=args.file_timeout)
        print(f"  {file}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, {r['seconds']:.0f} s",
              file=sys.stderr, flush=True)
    return results


def reread(files: list[str], work: Path) -> dict[str, dict]:
    """A previous run's JUnit XML, read again (the causes' grouping may have changed since)."""
    results = {}
    for file in files:
        if (work / f"{file}.xml").exists():
            results[file] = {**read_junit(work / f"{file}.xml"), "seconds": 0.0, "timed_out": False}
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    suite = find_suite(args.suite)
    check_modules()
    files = pick_files(suite, args.files)
    if args.reread and not args.work:
        sys.exit("--reread reads the JUnit XML a run left in --work DIR")
    work = Path(args.work or tempfile.mkdtemp(prefix="llama-server-suite-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"suite {suite}\nlogs and JUnit XML in {work}\n", flush=True)
    results = reread(files, work) if args.reread else run_files(files, suite=suite, work=work, args=args)
    print()
    totals = print_table(results)
    if args.failures:
        print_failures(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"suite": str(suite), "command": sys.argv, "totals": totals,
                                               "files": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
