"""What the live page (`lever serve`'s `/`) costs a generation, measured side by side.

The same prompts through one open pipeline three ways, in turns (each round in another order):
unwatched (no Watch at all), watched with nobody reading (a server with the page on whose page
is closed), and watched with a reader (a page open: every cycle built into an event). Prints
ms/token of each, the two watched runs over the unwatched one as geometric means with their
range over prompts x rounds, and the Watch's own time as a share of decoding; checks the tokens
are the same every way.

    python examples/watch_cost.py -c examples/lever.toml --rounds 2 --n-gen 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import lever
from lever.pipelines.watch import Watch
from lever.shipped import shipped

PROMPTS = ["def parse_args(argv):", "import os\n\ndef walk(root):", "class Config:\n    def __init__(self",
           "def read_lines(path):"]
WAYS = ("unwatched", "nobody reading", "a reader")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", default=str(shipped("default.toml")))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=64)
    args = ap.parse_args(argv)
    ms = {w: [] for w in WAYS}
    own, same = [], True
    with lever.load(args.config) as llm:
        tok = llm.tokenizer
        watch = Watch(lambda t: tok.token_bytes(t).decode("utf-8", "replace"))
        for r in range(args.rounds):
            for i, prompt in enumerate(PROMPTS):
                ways = WAYS[(r + i) % 3:] + WAYS[:(r + i) % 3]  # each way first, middle and last in turn
                tokens = set()
                for way in ways:
                    llm.watch = None if way == "unwatched" else watch
                    watch.readers = int(way == "a reader")
                    c = llm.generate(prompt, max_tokens=args.n_gen)
                    tokens.add(c.tokens)
                    decode_s = c.stats.timing.decode_s
                    ms[way].append(1e3 * decode_s / max(len(c.tokens) - 1, 1))
                    if way == "a reader":
                        end = json.loads(watch.since(watch.since(2**62)[1] - 1)[0][0].data)
                        own.append(end["watch_ms"] / 1e3 / decode_s)
                same &= len(tokens) == 1
        llm.watch = None
    print(f"{'':16} {'ms/token':>9} {'over unwatched':>15} {'range':>13}")
    result = {"same_tokens": same, "own_share": statistics.mean(own)}
    for way in WAYS:
        ratios = [a / b for a, b in zip(ms[way], ms["unwatched"])]
        g = statistics.geometric_mean(ratios)
        result[way] = {"ms_per_token": statistics.median(ms[way]), "ratio": g, "lo": min(ratios), "hi": max(ratios)}
        print(f"{way:16} {statistics.median(ms[way]):9.2f} {g:14.3f}x {min(ratios):6.3f}-{max(ratios):.3f}")
    print(f"the Watch's own time with a reader: {100 * result['own_share']:.2f}% of decoding; "
          f"tokens {'the same' if same else 'DIFFERENT'} every way")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["same_tokens"] else 1)
