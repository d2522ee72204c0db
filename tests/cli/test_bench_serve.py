"""`lever bench serve`: its phases run against real servers, and what it reports holds: the good
client is answered in every phase, each attack gets its refusal, the servers stop with 143."""

from __future__ import annotations

import json

from lever.cli.bench.serve import bench_serve


def test_bench_serve_reports_a_good_client_answered_through_every_attack(tmp_path):
    lines = []
    # the attackers at the bench's priority: at its lowest (the command's) they crawl on a loaded machine
    r = bench_serve(None, [], 6.0, out=lines.append, json_path=tmp_path / "serve.json", nice=0)
    phases = r["phases"]
    assert set(phases) == {"calm", "fat bodies", "slow bodies", "reader burst", "cache pressure", "long streams",
                           "hostile", "template"}
    for name, p in phases.items():
        assert p["good"] > 0 and p["failed"] == 0, (name, p["status"])
    seen = phases["hostile"]["hostile"]
    assert phases["slow bodies"]["hostile"].get("slow body 408", 0) > 0 and phases["long streams"]["good"] > 0
    turned_away = ("429", "503", "connection closed")  # by the key's share, the pool or the connection cap first
    for kind in ("bodies 400", "declared 500 MiB 413", "no key 401", "rebound host 421", "cross-site 403",
                 "form body 415", "forged turn 200", "grammar refs 400", "grammar GBNF 400", "grammar repeats 400"):
        name = kind.rsplit(" ", 1)[0]
        tried = {k: v for k, v in seen.items() if k.startswith(name + " ")}
        assert seen.get(kind, 0) > 0 or (tried and all(k.endswith(turned_away) for k in tried)), (kind, seen)
    assert any(k.startswith("crowd") for k in seen) and any(k.startswith("slow headers") for k in seen)
    assert phases["template"]["hostile"].get("endless template 400", 0) > 0
    assert all(not p["hostile"].get("attackers still running when counted") for p in phases.values()), phases
    fat = phases["fat bodies"]["hostile"]
    # refused unparsed (413) or unread past the key's rate for bodies (408), never served; the ones that
    # parse served, or turned away while the key holds its share (of the rate, the pool or the queue)
    fat_body = {k for k in fat if k.startswith("fat body ")}
    assert fat_body and fat_body <= {"fat body 413", "fat body 408", "fat body 429", "fat body 503",
                                     "fat body connection closed"}, fat
    assert {k for k in fat if k.startswith("fat parsed ")} <= {"fat parsed 200", "fat parsed 408", "fat parsed 503",
                                                                 "fat parsed 429", "fat parsed connection closed"}, fat
    assert 0 < seen["live burst, most let in"] <= 8 and any(k.startswith("slow body") for k in seen), seen
    assert seen.get("cache pressure 200", 0) > 0
    for p in (phases["calm"], phases["hostile"]):  # the good key's conversation came back, whatever the attacker did
        assert p["conversation_cached"] >= p["conversation_tokens"] - 8 > 100, p
    summary = r["summary"]
    assert {k: summary[k] for k in ("exit_codes", "tracebacks", "within_plan", "killed")} == \
        {"exit_codes": [143, 143], "tracebacks": 0, "within_plan": True, "killed": False}
    assert json.loads((tmp_path / "serve.json").read_text())["summary"]["tracebacks"] == 0
    assert any("server exits 143 and 143" in ln for ln in lines)
