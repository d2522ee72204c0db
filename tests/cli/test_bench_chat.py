"""`lever bench chat` on the shipped pair: four runs of one conversation, the same replies, and
the session's turns taking their prefix from the caches."""

from __future__ import annotations

import json

from lever.cli.bench.chat import bench_chat
from lever.shipped import shipped

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def test_bench_chat_runs_four_ways_with_the_same_replies(tmp_path):
    lines = []
    path = tmp_path / "chat.json"
    r = bench_chat(str(shipped("default.toml")), ["import os", "import sys", "def main():"], 8,
                   [f"model.chat_template={json.dumps(TEMPLATE)}"], out=lines.append, json_path=str(path))
    s = r["summary"]
    assert s["same_replies"] and set(r["runs"]) == {"flash-ar", "flash-ar + session", "lever", "lever + session"}
    assert s["cached_tokens"][0] == 0 and all(c > 0 for c in s["cached_tokens"][1:])
    assert all(t["tokens"] == 8 and 0 < t["ttft_s"] <= t["total_s"] for v in r["runs"].values() for t in v)
    assert json.loads(path.read_text())["summary"]["cached_tokens"] == s["cached_tokens"]
    assert any("Flash-AR's speed per turn" in x for x in lines)
    kept, dropped = s["taking_turns"]["kept"]["cached"], s["taking_turns"]["dropped"]["cached"]
    assert all(k > d for k, d in zip(kept[1:], dropped[1:]))  # a returning conversation comes back whole
    assert any("returning, kept" in x for x in lines)
