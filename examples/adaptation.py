"""Online adaptation, shown: the flash slows down mid-run and Lever's trees follow it.

One generation runs at the config's speed for `--after` passes; then every flash read takes
`--slow-ms` longer (the fault injector's latency: a throttled or busy flash), to the end. With
`[tree_expand] adapt` on (the default), the measured reads correct the cost model cycle by
cycle and the trees grow; with it off they keep the profile's size. Beside them, fixed
policies run slowed from the start, for the best a fixed policy does at the new speed.

Run: python examples/adaptation.py -c examples/lever.toml [--after 6] [--slow-ms 30] [-n 96]
"""

from __future__ import annotations

import argparse
import sys

from lever.backends.flash.faults import Faults, inject
from lever.config import load_config
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec
from lever.pipelines.engine import run_pipeline

PROMPT = 'def parse_duration(text):\n    """Parse "1h30m", "45s" or "2d" into seconds."""\n'
FIXED = {"chain k=4": ['tree_expand.policy="chain"', "tree_expand.chain_length=4"],
         "chain k=8": ['tree_expand.policy="chain"', "tree_expand.chain_length=8"],
         "edgellm-like": ['tree_expand.policy="confidence"']}


def run(config: str, sets: list[str], prompt: str, n: int, *, slow_s: float, after: int | None) -> dict:
    """One generation; from the end of pass `after` on (None: from the start) every read is slower."""
    cfg = load_config(config, [*sets, f"generate.n_predict={n}", 'pipeline.kind="speculative"'])
    faults = Faults(slow_s=slow_s, slow_from=0 if after is None else None)
    last_layer = read_spec(GGUFFile(cfg.model.target)).n_layer - 1
    passes = [0]

    def observer(layer, tree, x):  # after every layer of every pass: count passes, then slow the flash
        if layer == last_layer:
            passes[0] += 1
            if after is not None and passes[0] == after + 1:  # the prefill is pass 0
                faults.slow_from = 0

    with inject(faults):
        res = run_pipeline(cfg, prompt, observer=observer)
    return {"tokens": res.tokens, "cycles": res.trees.cycles}


def rate(cycles, start: int, stop: int | None = None) -> float:
    """Tokens per second over cycles[start:stop]."""
    part = cycles[start:stop]
    return sum(c.tokens for c in part) / max(sum(c.measured_s for c in part), 1e-9)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-p", "--prompt", default=PROMPT)
    ap.add_argument("-n", type=int, default=96, help="tokens to generate")
    ap.add_argument("--after", type=int, default=6, help="decoding passes at full speed")
    ap.add_argument("--slow-ms", type=float, default=30.0, help="added to every flash read after the switch")
    ap.add_argument("--settle", type=int, default=5, help="cycles after the switch not counted in the new speed's rate")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    a = ap.parse_args(argv)
    slow_s, sets = a.slow_ms / 1e3, [*a.set, 'tree_expand.policy="gain-cost"']
    adapt = run(a.config, [*sets, "tree_expand.adapt=true"], a.prompt, a.n, slow_s=slow_s, after=a.after)
    fixed = run(a.config, [*sets, "tree_expand.adapt=false"], a.prompt, a.n, slow_s=slow_s, after=a.after)
    k = a.after
    print(f"flash slowed by {a.slow_ms:g} ms a read after decoding pass {k}")
    print(f"{'cycle':>5} {'nodes':>6} {'ms':>7} {'tokens':>6} {'read x':>7}   {'nodes (adapt off)':>17}")
    for i, c in enumerate(adapt["cycles"]):
        off = fixed["cycles"][i].nodes if i < len(fixed["cycles"]) else ""
        mark = "  <- slower from here" if i == k else ""
        print(f"{i + 1:>5} {c.nodes:>6} {1e3 * c.measured_s:>7.0f} {c.tokens:>6} {c.scales.read:>7.2f}"
              f"   {off:>17}{mark}")
    ref = {name: run(a.config, [*a.set, *extra], a.prompt, a.n, slow_s=slow_s, after=None)
           for name, extra in FIXED.items()}
    ref["gain-cost, slow from the start"] = run(a.config, sets, a.prompt, a.n, slow_s=slow_s, after=None)
    settled = k + a.settle
    result = {"before_tps": rate(adapt["cycles"], 0, k), "after_tps": rate(adapt["cycles"], settled),
              "after_tps_adapt_off": rate(fixed["cycles"], settled),
              "fixed_tps": {name: rate(r["cycles"], 0) for name, r in ref.items()},
              "nodes_before": [c.nodes for c in adapt["cycles"][:k]],
              "nodes_after": [c.nodes for c in adapt["cycles"][k:]],
              "same_tokens": all(r["tokens"] == adapt["tokens"] for r in (fixed, *ref.values()))}
    best = max(result["fixed_tps"], key=result["fixed_tps"].get)
    print(f"tokens/s before the slowdown {result['before_tps']:.2f}; after it (from cycle {settled + 1}) "
          f"{result['after_tps']:.2f} adapting, {result['after_tps_adapt_off']:.2f} with adapt off")
    print("slow from the start: " + ", ".join(f"{k} {v:.2f}" for k, v in result["fixed_tps"].items())
          + f"; adapting reaches {result['after_tps'] / result['fixed_tps'][best]:.2f}x the best ({best})")
    print("tokens: " + ("the same in every run" if result["same_tokens"] else "DIFFERENT between runs"))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
