"""`lever serve [-c CONFIG] [--host H] [--port P] [--queue N]`: the OpenAI-compatible server
(lever.serve) over the configured pipeline, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lever.cli.common import add_common, add_set
from lever.errors import LeverError
from lever.shipped import shipped

MAX_QUEUE = 1024


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the configured pipeline")
    s.add_argument("-c", "--config", type=Path, default=None, help="TOML config (default: the shipped pair)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--queue", type=int, default=8, help="requests that may wait beside the running one; then 429")
    add_set(s)
    add_common(s)
    s.set_defaults(func=main)
    return s


def main(args) -> int:
    if not 0 <= args.queue <= MAX_QUEUE:
        raise LeverError(f"--queue: must be in [0, {MAX_QUEUE}], got {args.queue}")
    if not 0 <= args.port <= 65535:
        raise LeverError(f"--port: must be in [0, 65535], got {args.port}")
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
