"""/metrics (lever.serve.metrics): Prometheus's text format, llama-server's series by its own
names (llamacpp:...) and Lever's prefixed lever:, totals that add up to the responses' own
timings, llama-server's Process-Start-Time-Unix header; 501 unless the server was started with
--metrics."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from lever.serve.metrics import LLAMA, PREFIX, SERIES
from tests.serve.live import start_server, stop

PROMPT = "def parse_args(argv):"
SAMPLE = re.compile(r'^(?:lever|llamacpp):([a-z_]+)(\{status="(\d+)"\})? (-?[0-9.e+-]+)$')


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert abs(int(r.headers["process-start-time-unix"]) - time.time()) < 24 * 3600  # when the server started
    values = {}
    for line in r.text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) (lever|llamacpp):[a-z_]+ .+$", line), line
            continue
        m = SAMPLE.match(line)
        assert m, line
        values[(m.group(1), m.group(3))] = float(m.group(4))
    return values


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--metrics")
    yield proc, url
    stop(proc)


def test_totals_add_up_to_the_responses_timings(server):
    url = server[1]
    before = scrape(url)
    assert {name for name, _ in before} == set(SERIES) - {"requests_total"}  # no answers yet
    t1 = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12}, timeout=60).json()["timings"]
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 7, "stream": True},
                      timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    t2 = json.loads(lines[-2][6:])["timings"]
    assert httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": -1}).status_code == 400
    m = scrape(url)
    assert m[("tokens_predicted_total", None)] == 12 + 7
    # the second prefilled only what the session's caches did not hold
    assert m[("prompt_tokens_total", None)] == t1["prompt_n"] + t2["prompt_n"] and t2["cache_n"] > 0
    assert m[("prompt_tokens_cached_total", None)] == t1["cache_n"] + t2["cache_n"]
    assert m[("n_tokens_max", None)] >= t1["prompt_n"] + 12
    assert m[("spec_decode_num_accepted_tokens_total", None)] <= m[("spec_decode_num_draft_tokens_total", None)]
    assert 0 < m[("draft_acceptance_ratio", None)] <= 1 and m[("tokens_per_pass", None)] > 1
    assert m[("requests_total", "200")] == 2 and m[("requests_total", "400")] == 1
    assert m[("requests_processing", None)] == 0 and m[("requests_deferred", None)] == 0


def test_without_the_flag_metrics_is_501_naming_it():
    proc, url = start_server()
    try:
        r = httpx.get(url + "/metrics")
        assert r.status_code == 501 and "--metrics" in r.json()["error"]["message"]
    finally:
        stop(proc)


def test_every_series_has_a_help_and_a_type():
    assert all(kind in ("counter", "gauge") and text.endswith(".") for _, kind, text in SERIES.values())
    # llama-server's names (n_tokens_max is its counter without _total), Lever's own under its prefix
    assert all(name.endswith("_total") == (kind == "counter") for name, (_, kind, _) in SERIES.items()
               if name != "n_tokens_max")
    assert {p for p, _, _ in SERIES.values()} == {LLAMA, PREFIX} == {"llamacpp:", "lever:"}
