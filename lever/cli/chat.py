"""`lever chat [-c CONFIG]`: a terminal conversation through the configured pipeline.

Each line you type is a user turn; the reply streams as it is decoded, through the target's
chat template, in a session whose KV caches keep the conversation (a turn prefills only its
own tokens). `/reset` starts over, `/save FILE` writes the session (conversation and caches)
and `/load FILE` reads one back, `/exit` or end of input leaves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lever.cli.common import add_common, add_knobs, add_set, check_sets, input_text_file, knob_values
from lever.config import KNOBS
from lever.errors import LeverError
from lever.outputs import writable_destination
from lever.shipped import shipped

HELP = "/reset: start over · /save FILE · /load FILE · /exit"


def add_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("chat", help="a terminal chat through the configured pipeline, streamed")
    c.add_argument("-c", "--config", type=Path, default=None, help="TOML config (default: the shipped pair)")
    c.add_argument("--system", default=None, help="a system message to start the conversation with")
    add_knobs(c, "n_predict", "temperature", "seed", defaults={"n_predict": 256}, call=True)  # -n: per reply
    add_set(c)
    add_common(c)
    c.set_defaults(func=main, check=check_args)
    return c


def check_args(args) -> None:
    if args.config is not None:
        input_text_file(args.config, "-c", "config file")
    check_sets(args)


def main(args) -> int:
    check_args(args)
    from lever.api import load

    out, err = sys.stdout, sys.stderr
    interactive = sys.stdin.isatty()
    with load(args.config or shipped("default.toml"), overrides=args.set) as llm:
        llm.chat_template  # noqa: B018  a model without a template fails here, before the first turn
        sampling = {KNOBS[key].arg: v for key, v in knob_values(args).items()}
        with llm.session() as s:
            if args.system:
                s.messages.append({"role": "system", "content": args.system})
            if interactive:
                print(f"lever chat ({Path(llm.config.model.target).name}); {HELP}", file=err)
            while True:
                try:
                    line = input("> " if interactive else "")
                except EOFError:
                    break
                text = line.strip()
                if not text:
                    continue
                if text.startswith("/"):
                    cmd, _, arg = text.partition(" ")
                    if cmd == "/exit":
                        break
                    if cmd == "/reset":
                        s.reset()
                        if args.system:
                            s.messages.append({"role": "system", "content": args.system})
                        print("(the conversation starts over)", file=err)
                    elif cmd in ("/save", "/load") and arg:
                        try:  # a wrong name is one line; the conversation goes on
                            if cmd == "/save":
                                s.save(writable_destination(arg.strip(), "/save"))
                                print(f"(saved {len(s.messages)} messages, {s.n_cached} cached tokens "
                                      f"to {arg.strip()})", file=err)
                            else:
                                s.load(arg.strip())
                                print(f"(loaded {len(s.messages)} messages, {s.n_cached} cached tokens)", file=err)
                        except LeverError as e:
                            print(f"lever: error: {e}", file=err)
                    else:
                        print(f"(unknown command {cmd!r}; {HELP})", file=err)
                    continue
                n_before = len(s.messages)
                try:
                    for chunk in s.stream_chat([{"role": "user", "content": text}], **sampling):
                        out.write(chunk.text)
                        out.flush()
                        if chunk.finish_reason is not None:
                            out.write("\n")
                            out.flush()
                except LeverError as e:  # one bad turn (too long, a template that fails) does not end the chat
                    s.rewind(n_before)
                    print(f"lever: error: {e}", file=err)
    return 0
