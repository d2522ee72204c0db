"""`lever list [--json]`: the models in $LEVER_MODELS, and the catalogue's names, pulled or not.

The models are the GGUFs under the folder (a hub file under OWNER/REPO/) and the downloads a
pull left to resume (FILE.part), each with its name for `lever pull`, its size and its path
relative to the folder; the catalogue's state is by name and size (`lever pull NAME` checks
the sha256).
"""

from __future__ import annotations

import argparse
import json

from lever.cli.common import add_common
from lever.cli.table import show
from lever.hub.pull import catalogue_state, held, name_of
from lever.hub.store import models_dir


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("list", help="the models in $LEVER_MODELS and the names `lever pull` knows")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    add_common(p)
    p.set_defaults(func=main, check=check_args)
    return p


def check_args(args) -> None:
    """No arguments to check."""


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def main(args) -> int:
    root = models_dir()
    files, known = held(root), catalogue_state(root)
    if args.json:
        print(json.dumps({"root": str(root),
                          "models": [{"name": name_of(h), "size": h.size, "path": h.relative, "partial": h.partial}
                                     for h in files],
                          "catalogue": [{"name": k.name, "state": k.state, "files": list(k.files)} for k in known]}))
        return 0
    print(f"$LEVER_MODELS: {root}")
    if files:
        show(["name", "size", "path"], [(name_of(h), _size(h.size) + (" (partial)" if h.partial else ""), h.relative)
                                       for h in files])
    else:
        print("(no models yet)")
    print()
    show(["catalogue", "state", "what"], [(k.name, k.state, k.about) for k in known])
    return 0
