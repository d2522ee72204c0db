"""`lever bench live`'s server row: `lever serve` under the cap that moves, a client streaming
request after request through every change (issue 50: no request lost, no 5xx a change caused,
each answer the one its prompt gets once the cap stops moving).

Where it sits: below lever.cli.bench.live (which turns what this returns into the row's figures),
over lever.cli.bench.cgroup's group and CapMover and lever.cli.bench.serve's Live server. The
schedule's zero is the moment the server first answers /health (its load is not the cap's to
move: a phone's app is running when another opens).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import attrs

from lever.cli.bench.cgroup import CapMover, _controller, evict, memory_group
from lever.cli.bench.serve import KEY, Live

N_PREDICT = 32  # tokens a request asks for: several requests in each phase of the deep target
STREAM_TIMEOUT_S = 900.0  # one request's whole stream, on a target streamed at ~1 token/s
LOST, STREAM_ERROR = -1, 0  # a request's "status": the connection went; an error event ended its stream


@attrs.frozen
class Served:
    """What the server and its client did under the moving cap (the fields row_figures reads as
    it reads a Scheduled run's)."""

    returncode: int | None  # None: alive at the end (stopped by the bench)
    killed_by_cap: bool
    stderr: str
    samples: tuple[tuple[float, int, int], ...]
    changes: tuple[tuple[float, int, float | None], ...]
    peak_bytes: int
    started_s: float  # the schedule's zero (monotonic): the server's first answer
    wall_s: float
    series: tuple[tuple[float, int], ...]  # (s since the zero, tokens streamed so far) over every request
    answers: tuple[tuple[int, int, str], ...]  # (prompt index, HTTP status, LOST or STREAM_ERROR; text or why)
    still: tuple[str, ...]  # each prompt's answer once the cap was still (the last change `tail_s` behind)


def stream_one(url: str, prompt: str, on_tokens) -> tuple[int, str]:
    """One streamed /completion (greedy, nothing from the prompt cache): (status, text);
    `on_tokens(n)` as each chunk comes."""
    import httpx

    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": False, "stream": True}
    text = ""
    with httpx.stream("POST", url + "/completion", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=STREAM_TIMEOUT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:  # failed mid-stream: the status was sent before, the error event says it
                    return STREAM_ERROR, str(chunk["error"].get("message", chunk["error"]))[:300]
                text += chunk.get("content", "")
                on_tokens(len(chunk.get("tokens", ())))
        return r.status_code, text


def serve_moved(*, config: str | None, sets: list[str], prompts: list[str], start: int,
                schedule: list[tuple[float, int]], grace_s: float, tail_s: float, n_ctx: int,
                evict_paths=(), sample_s: float = 0.1) -> Served:
    """The server in a group of `start` bytes whose cap follows `schedule` from its first answer,
    the client streaming `prompts` in turn until `tail_s` after the last change, then each prompt
    once more with the cap still."""
    import httpx

    _, limit_file, _ = _controller()
    with memory_group(start) as group:
        for p in evict_paths:
            evict(p)
        live = Live(config, sets, "--mem", str(start), "--ctx-size", str(n_ctx), "--no-page", wrap=group.joined)
        t0 = time.monotonic()
        mover = CapMover(group, group.path / limit_file, start, sorted(schedule), grace_s, t0)
        series, answers, still, n = [], [], [], [0]
        end = t0 + (max((s for s, _ in schedule), default=0.0) + tail_s)

        def counted(k: int) -> None:
            n[0] += k
            series.append((time.monotonic() - t0, n[0]))

        def client() -> None:
            i = 0
            while time.monotonic() < end and live.proc.poll() is None:
                try:
                    answers.append((i % len(prompts), *stream_one(live.url, prompts[i % len(prompts)], counted)))
                except httpx.HTTPError as e:  # the connection went: a lost request
                    answers.append((i % len(prompts), LOST, f"{type(e).__name__}: {e}"))
                i += 1
            for p in prompts:  # the cap still since `tail_s`: what each prompt gets untouched by a move
                try:
                    still.append(stream_one(live.url, p, lambda k: None)[1])
                except httpx.HTTPError as e:
                    still.append(f"{type(e).__name__}: {e}")

        t = threading.Thread(target=client, daemon=True)
        t.start()
        while t.is_alive():
            mover.tick(live.proc)
            time.sleep(sample_s)
        alive = live.proc.poll() is None
        code = live.stop()
        return Served(returncode=None if alive else code, killed_by_cap=mover.killed, stderr=live.stderr(),
                      samples=tuple(mover.samples), changes=tuple(tuple(c) for c in mover.changes),
                      peak_bytes=group.peak_bytes, started_s=t0, wall_s=time.monotonic() - t0, series=tuple(series),
                      answers=tuple(answers), still=tuple(still))


def request_figures(served: Served) -> dict:
    """How the requests ended, and whether each answer is its prompt's answer with the cap still."""
    status = Counter(str(s) for _, s, _ in served.answers)
    differ = [i for i, (p, s, text) in enumerate(served.answers)
              if s == 200 and (p >= len(served.still) or text != served.still[p])]
    return {"requests": len(served.answers), "status": dict(status), "lost": status.get(str(LOST), 0),
            "stream_errors": status.get(str(STREAM_ERROR), 0),
            "server_errors": sum(v for k, v in status.items() if k.startswith("5")), "differ": differ,
            "answers": [list(a) for a in served.answers], "still": list(served.still)}
