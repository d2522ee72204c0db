"""examples/watch_cost.py on the shipped pair: being watched changes no token, and the Watch's
own time is measured (a share of decoding, below all of it)."""

import importlib.util

from tests.conftest import ROOT


def test_watched_runs_give_the_same_tokens_and_their_cost_is_measured(capsys):
    spec = importlib.util.spec_from_file_location("watch_cost", ROOT / "examples" / "watch_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--rounds", "1", "--n-gen", "24"])
    assert r["same_tokens"]
    assert 0 < r["own_share"] < 1
    assert all(r[w]["ms_per_token"] > 0 and r[w]["lo"] <= r[w]["ratio"] <= r[w]["hi"] for w in mod.WAYS)
    assert "the Watch's own time with a reader" in capsys.readouterr().out
