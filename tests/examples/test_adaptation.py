"""examples/adaptation.py on the shipped pair: a flash slowed mid-run grows the trees, output unchanged."""

import importlib.util

from tests.conftest import ROOT


def test_a_slower_flash_mid_run_grows_the_trees(capsys):
    spec = importlib.util.spec_from_file_location("adaptation", ROOT / "examples" / "adaptation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.FIXED = {"chain k=8": mod.FIXED["chain k=8"]}  # one fixed reference is enough here (time)
    r = mod.main(["-c", str(ROOT / "examples" / "default.toml"), "-n", "48", "--after", "3", "--slow-ms", "12",
                  "--settle", "2", "--set", "flash.dram_budget=0.0"])
    assert r["same_tokens"]  # lossless whatever the trees were
    before, after = r["nodes_before"], r["nodes_after"]
    assert before and len(after) > 3
    assert sum(after[2:]) / len(after[2:]) > sum(before) / len(before)  # within two cycles of the switch
    out = capsys.readouterr().out
    assert "<- slower from here" in out and "adapting reaches" in out
