"""`lever bench {model,flash,pipelines,sources,chat,fuzz,cap,serve,fim,clients,live}`: benchmarks printed as ratios
measured side by side.

Speed goals live here, never in timed unit tests: each bench measures the baseline in the same
run, on the same machine load, and prints the ratio.
"""

from __future__ import annotations

import argparse
import functools

from lever.cli.bench import cap, chat, clients, fim, flash, fuzz, live, model, pipelines, serve, sources
from lever.cli.common import usage_error

BENCHES = (model, flash, pipelines, sources, chat, fuzz, cap, serve, fim, clients, live)


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="benchmarks printed as ratios measured side by side")
    b.error = functools.partial(usage_error, b)  # `lever bench nope`: one line, as every command's
    benches = b.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(x.__name__.rsplit(".", 1)[1]
                                                                               for x in BENCHES) + "}")
    for bench in BENCHES:
        bench.add_parser(benches)
    return b
