"""examples/shared_passes.py on the shipped pair: clients at once give the tokens each gives
alone, and shared passes (no timing asserted: the machine is shared)."""

import importlib.util

from lever.shipped import shipped
from tests.conftest import ROOT


def test_clients_at_once_give_their_own_tokens_in_shared_passes(capsys):
    spec = importlib.util.spec_from_file_location("shared_passes", ROOT / "examples" / "shared_passes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    one, three = mod.main([str(shipped("default.toml")), "--clients", "1,3", "-n", "12",
                           "--set", "flash.dram_budget=0"])
    assert three["tokens"][0] == one["tokens"][0]  # the same first prompt, alone and beside two others
    assert three["passes"] < three["trees"]
    assert "3 client(s)" in capsys.readouterr().out
