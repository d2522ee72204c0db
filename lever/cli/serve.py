"""`lever serve [-c CONFIG] [--host H] [--port P] [--queue N]`: the OpenAI-compatible server
(lever.serve) over the configured pipeline, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lever.cli.common import add_common, add_set, check_sets, input_text_file, int_in, port
from lever.errors import LeverError
from lever.shipped import shipped

MAX_QUEUE = 1024


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the configured pipeline")
    s.add_argument("-c", "--config", type=Path, default=None, help="TOML config (default: the shipped pair)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port, default=8080)
    s.add_argument("--queue", type=int_in(0, MAX_QUEUE), default=8,
                   help="requests that may wait beside the running one; then 429")
    add_set(s)
    add_common(s)
    s.set_defaults(func=main, check=check_args)
    return s


def check_args(args) -> None:
    """--port and --queue are bounded by their types (lever.cli.common); the rest, before loading."""
    if not args.host or any(c.isspace() for c in args.host):
        raise LeverError(f"--host: not a host name or address: {args.host!r}")
    if args.config is not None:
        input_text_file(args.config, "-c", "config file")
    check_sets(args)


def main(args) -> int:
    check_args(args)
    try:
        import uvicorn

        from lever.serve import app
    except ImportError as e:
        raise LeverError(f"lever serve needs the serve extra: pip install 'lever[serve]' ({e.name} is missing)") from None
    from lever.api import load

    llm = load(args.config or shipped("default.toml"), overrides=args.set)
    try:
        model_id = Path(llm.config.model.target).stem
        config = uvicorn.Config(app(llm, model_id=model_id, queue=args.queue), host=args.host, port=args.port,
                                log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        print(f"lever serve: http://{args.host}:{args.port}/v1 ({model_id}, {llm.config.pipeline.kind}), "
              f"queue {args.queue}", file=sys.stderr, flush=True)
        server.run()
    finally:
        llm.close()
    return 0
