"""`lever bench live`: its schedule, its rates over time, and each phase against the run started at
its cap over the same tokens; the runs themselves are tests/cli/test_live_memory.py's mechanism."""

from __future__ import annotations

import random

import pytest

from lever.cli.bench.live import compare, generated, parse_schedule, phases, rate, same_tokens_s
from lever.errors import LeverError

MIB = 1 << 20


def test_the_schedule_is_sorted_and_a_bad_change_is_one_line_naming_it():
    assert parse_schedule(["60=3G", "20=1536M"]) == [(20.0, 1536 * MIB), (60.0, 3 << 30)]
    for bad in ("20", "x=1G", "20=lots", "-1=1G", "20=1M"):
        with pytest.raises(LeverError, match=f"--then: {bad!r}"):
            parse_schedule([bad])


def test_phases_cover_the_run_and_rates_count_what_came_inside():
    assert phases([(20.0, 1), (60.0, 2)], 3, 100.0) == [(0.0, 20.0, 3), (20.0, 60.0, 1), (60.0, 100.0, 2)]
    series = [(float(t), t) for t in range(1, 101)]  # a token a second
    assert rate(series, 10.0, 20.0) == pytest.approx(1.0) and rate(series, 200.0, 300.0) is None


def test_a_phase_is_compared_over_the_same_tokens_whatever_the_speeds():
    rng = random.Random(3)
    for _ in range(50):
        k = rng.uniform(0.5, 2.0)  # the live run is k times the reference's speed
        ref = [(10.0 + i / 2.0, i) for i in range(1, 301)]  # 2 tok/s after 10 s of prefill
        start = rng.uniform(0.0, 30.0)
        live_series = [(start + i / (2.0 * k), i) for i in range(1, 301)]
        live = {"series": live_series, "phases": [{"from_s": start + 20.0, "to_s": start + 60.0, "cap_bytes": 1}]}
        compare(live, {1: {"series": ref}})
        p = live["phases"][0]
        assert p["vs_started_there"] == pytest.approx(k, rel=0.05)
        a, b = p["tokens"]
        assert same_tokens_s(ref, a, b) == pytest.approx((b - a) / 2.0, abs=0.6)


def test_a_served_request_counts_as_lost_failed_or_equal_by_what_it_got():
    from lever.cli.bench.live_serve import LOST, STREAM_ERROR, Served, request_figures

    rng = random.Random(5)
    for _ in range(50):
        still = tuple(f"answer {i}" for i in range(3))
        answers, want = [], {"lost": 0, "stream_errors": 0, "server_errors": 0, "differ": []}
        for k in range(rng.randint(0, 12)):
            p = rng.randrange(3)
            kind = rng.choice(["same", "same", "other", "lost", "error", "503"])
            status, text = {"same": (200, still[p]), "other": (200, "something else"), "lost": (LOST, "gone"),
                            "error": (STREAM_ERROR, "memory: ..."), "503": (503, "busy")}[kind]
            answers.append((p, status, text))
            want["lost"] += kind == "lost"
            want["stream_errors"] += kind == "error"
            want["server_errors"] += kind == "503"
            want["differ"] += [k] if kind == "other" else []
        served = Served(returncode=None, killed_by_cap=False, stderr="", samples=(), changes=(), peak_bytes=0,
                        started_s=0.0, wall_s=1.0, series=(), answers=tuple(answers), still=still)
        got = request_figures(served)
        assert got["requests"] == len(answers) and {k: got[k] for k in want} == want


def test_a_tools_echo_of_the_prompt_is_not_counted_as_generated():
    rng = random.Random(9)
    for _ in range(200):
        prompt = "".join(rng.choice("ab \n") for _ in range(rng.randint(1, 120)))
        out = "".join(rng.choice("xyz\n") for _ in range(rng.randint(0, 80)))
        lead = rng.choice(["", " ", "<s>", "\n"])
        echoed = lead + prompt.lstrip() + out
        for cut in range(0, len(echoed) + 1, 7):  # as it streams in
            got = generated(echoed[:cut], prompt)
            assert out.startswith(got) and (cut < len(echoed) or got == out), (prompt, lead, cut)
        if prompt.strip():
            assert generated(out, prompt) in (out, "")  # no echo: what it printed, all of it


def test_the_printed_figures_are_rounded_and_a_cap_never_met_says_so():
    from lever.cli.bench.live import _print

    rng = random.Random(5)
    for _ in range(50):
        met = rng.choice([None, rng.uniform(0, 3)])
        phase = {"settled_tps": rng.choice([None, rng.uniform(0, 5)]), "from_s": 0.0, "to_s": rng.uniform(1, 200),
                 "cap_bytes": rng.randrange(1, 8) << 30, "met_after_s": met, "held_max_bytes": rng.randrange(1 << 32)}
        row = {"killed_by_cap": False, "alive": True, "tokens": [1], "n_tokens": 1, "peak_bytes": 1 << 30,
               "phases": [phase]}
        lines: list[str] = []
        _print({"lever": row}, [1], lines.append)
        line = lines[1]
        assert (f"cap met after {met:.2f} s," if met is not None else "cap never met,") in line, line
        decimals = [w.rstrip(",;-").split(".")[-1] for w in line.replace("-", " ").split() if "." in w]
        assert all(len(d) <= 2 for d in decimals), line
