"""`lever bench chat -c CONFIG`: the paper's chat row, a conversation of several turns.

Per turn: time to the first token of the reply and to its end, for Flash-AR and Lever, each
with a session (the conversation stays in both KV caches, a turn prefills only its own tokens)
and without (every turn prefills the whole conversation through flash again). One process,
one pipeline loaded at a time, the same turns; the replies must be the same text in all four
(greedy), which the bench checks.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lever.cli.bench import rows
from lever.cli.bench.report import read_prompts
from lever.cli.common import (
    MAX_PROMPT_BYTES,
    add_common,
    add_set,
    bench_tokens,
    check_sets,
    input_text_file,
    int_in,
    output_file,
)
from lever.cli.models import add_models, bench_config, check_models
from lever.cli.table import show
from lever.errors import LeverError
from lever.outputs import write_json
from lever.shipped import shipped

CACHE_BYTES = 256 << 20  # kept conversations, as `lever serve --cache-ram` keeps by default
PIPELINES = {"flash-ar": list(rows.FLASH_AR), "lever": list(rows.LEVER)}


def one_conversation(llm, turns: list[str], max_tokens: int, session: bool) -> list[dict]:
    """Each turn's reply, time to its first token and to its end (seconds), prompt tokens and
    how many of them came from the caches."""
    out, history = [], []
    s = llm.session() if session else None
    for text in turns:
        msg = [{"role": "user", "content": text}]
        t0 = time.perf_counter()
        first = None
        parts, cached, n_tok = [], 0, 0
        it = s.stream_chat(msg, max_tokens=max_tokens, temperature=0.0) if s else \
            llm.stream_chat(history + msg, max_tokens=max_tokens, temperature=0.0)
        for chunk in it:
            if first is None and chunk.n_tokens:
                first = time.perf_counter() - t0
            parts.append(chunk.text)
            n_tok += chunk.n_tokens
        total = time.perf_counter() - t0
        reply = "".join(parts)
        if s is not None:
            cached = s.last_cached
        history += [*msg, {"role": "assistant", "content": reply}]
        out.append({"reply": reply, "ttft_s": first or total, "total_s": total, "tokens": n_tok, "cached": cached})
    if s is not None:
        s.close()
    return out


def taking_turns(llm, turns: list[str], max_tokens: int, cache_bytes: int) -> list[dict]:
    """Two conversations of one client taking turns in one session (as a server's clients do):
    the first conversation's turns, each after a turn of the other; with `cache_bytes` the one
    leaving the caches is kept (lever.pipelines.prefix_cache), with 0 it is dropped."""
    from lever.pipelines.prefix_cache import PrefixCache

    s = llm.session()
    s.cache = PrefixCache(cache_bytes) if cache_bytes else None
    histories: list[list[dict]] = [[], []]
    out = []
    for text in turns:
        for k, history in enumerate(histories):
            msg = [*history, {"role": "user", "content": text if k == 0 else f"Another question. {text}"}]
            t0, first, parts = time.perf_counter(), None, []
            for chunk in llm.stream_call(llm.prepare(messages=msg, max_tokens=max_tokens, temperature=0.0),
                                         session=s):
                if first is None and chunk.n_tokens:
                    first = time.perf_counter() - t0
                parts.append(chunk.text)
            history[:] = [*msg, {"role": "assistant", "content": "".join(parts)}]
            if k == 0:
                out.append({"reply": "".join(parts), "ttft_s": first or time.perf_counter() - t0,
                            "cached": s.last_cached})
    s.close()
    return out


def bench_chat(config: str, turns: list[str], max_tokens: int, sets: list[str] = (), out=print,
               json_path: str | None = None) -> dict:
    from lever.api import load

    runs: dict[str, list[dict]] = {}
    for name, extra in PIPELINES.items():
        with load(config, overrides=[*sets, *extra]) as llm:
            llm.chat_template  # noqa: B018  refuse a model without a template before any timing
            for session in (False, True):
                runs[f"{name}{' + session' if session else ''}"] = one_conversation(llm, turns, max_tokens, session)
            if name == "lever":
                turning = {"kept": taking_turns(llm, turns, max_tokens, CACHE_BYTES),
                           "dropped": taking_turns(llm, turns, max_tokens, 0)}
    replies = {k: [t["reply"] for t in v] for k, v in runs.items()}
    same = len({tuple(r) for r in replies.values()}) == 1
    same &= all(t["reply"] == a["reply"] for v in turning.values() for t, a in zip(v, runs["lever + session"]))
    rows = []
    for i in range(len(turns)):
        row = [f"turn {i + 1}"]
        for v in runs.values():
            row.append(f"{v[i]['ttft_s']:.2f} / {v[i]['total_s']:.2f}")
        lev, far = runs["lever + session"][i], runs["flash-ar"][i]
        row.append(f"{far['total_s'] / lev['total_s']:.2f}x")
        rows.append(row)
    show(["", *(f"{k} (first token / reply, s)" for k in runs), "Lever+session vs Flash-AR"], rows, out,
         title=f"chat: {len(turns)} turns, {max_tokens}-token replies ({config})")
    ls, fs = runs["lever + session"], runs["flash-ar"]
    summary = {
        "speedup_per_turn": [f["total_s"] / lv["total_s"] for f, lv in zip(fs, ls)],
        "speedup_vs_flash_ar_session": [f["total_s"] / lv["total_s"] for f, lv in zip(runs["flash-ar + session"], ls)],
        "ttft_last_over_first": ls[-1]["ttft_s"] / ls[0]["ttft_s"] if ls[0]["ttft_s"] else 0.0,
        "ttft_last_over_first_no_session": runs["lever"][-1]["ttft_s"] / runs["lever"][0]["ttft_s"],
        "cached_tokens": [t["cached"] for t in ls], "same_replies": same}
    out(f"Lever with a session: {', '.join(f'{x:.2f}x' for x in summary['speedup_per_turn'])} Flash-AR's speed "
        f"per turn "
        f"(Flash-AR re-prefilling; {', '.join(f'{x:.2f}x' for x in summary['speedup_vs_flash_ar_session'])} against "
        f"Flash-AR with a session too); last turn's first token {summary['ttft_last_over_first']:.2f}x the first's "
        f"({summary['ttft_last_over_first_no_session']:.2f}x without a session); prompt tokens from the caches "
        f"{summary['cached_tokens']}; replies {'the same in every run' if same else 'DIFFERENT between runs'}")
    alone = runs["lever + session"]
    summary["taking_turns"] = {k: {"ttft_s": [t["ttft_s"] for t in v], "cached": [t["cached"] for t in v]}
                               for k, v in turning.items()}
    show(["", "alone (session)", "returning, kept", "returning, dropped"],
         [[f"turn {i + 1}", f"{alone[i]['ttft_s']:.2f}", f"{turning['kept'][i]['ttft_s']:.2f} "
           f"({turning['kept'][i]['cached']})", f"{turning['dropped'][i]['ttft_s']:.2f} "
           f"({turning['dropped'][i]['cached']})"] for i in range(len(turns))], out,
         title="Lever, first token (s) of one conversation's turns, alone or taking turns with another "
               "(prompt tokens from the caches)")
    result = {"config": config, "turns": turns, "max_tokens": max_tokens, "runs": runs, "summary": summary}
    if json_path:
        write_json(json_path, result)
    if not same:
        raise LeverError("bench chat: the replies differ between pipelines (greedy output must not)")
    return result


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("chat", help="a multi-turn chat: time to first token and per turn, with and without sessions")
    add_models(b, default="none: give -c or -m; the target needs a chat template")
    b.add_argument("--turns", type=Path, default=None, help="user turns separated by lines of --- (default: "
                   "examples/prompts/chat.txt)")
    b.add_argument("--n-turns", type=int_in(1, MAX_TURNS), default=4)
    b.add_argument("--max-tokens", type=bench_tokens, default=64, help="tokens per reply")
    b.add_argument("--json", type=Path, default=None)
    add_set(b)
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


MAX_TURNS = 64  # each turn is run four times (two pipelines, with and without a session)


def check_args(args) -> None:
    check_models(args)
    bench_config(args)  # -c or -m
    if args.turns is not None:
        input_text_file(args.turns, "--turns", "turns file", MAX_PROMPT_BYTES)
    output_file(args.json, "--json")
    check_sets(args)


def main(args) -> int:
    check_args(args)
    turns = read_prompts(args.turns or shipped("prompts", "chat.txt"))[: args.n_turns]
    config, sets = bench_config(args, say=print)
    bench_chat(config, turns, args.max_tokens, sets, json_path=args.json)
    return 0
