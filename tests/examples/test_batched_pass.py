"""examples/batched_pass.py on the shipped target: each request's states in the shared pass are
its own, and the figures it prints add up (no timing is asserted: the machine is shared)."""

import importlib.util

from lever.config import load_config
from lever.shipped import shipped
from tests.conftest import ROOT


def test_a_shared_pass_gives_each_request_its_own_states(capsys):
    spec = importlib.util.spec_from_file_location("batched_pass", ROOT / "examples" / "batched_pass.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    target = load_config(shipped("default.toml")).model.target
    r = mod.main([str(target), "--requests", "3", "--nodes", "5"])
    assert r["same"] and r["read_s"] > 0 and r["compute_s"] > 0 and r["each_s"] > 0
    assert "each request's hidden states as alone: True" in capsys.readouterr().out
