"""`lever serve [-c CONFIG] [--host H] [--port P] [--queue N]`: the OpenAI-compatible server
(lever.serve) over the configured pipeline, until SIGINT, SIGTERM or SIGHUP: then new requests get
503 and the admitted ones GRACE_S to finish before they are cancelled; exit 128 + the signal."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from lever import signals
from lever.cli.common import add_common, add_set, check_sets, input_text_file, int_in, port
from lever.errors import LeverError
from lever.shipped import shipped

MAX_QUEUE = 1024
GRACE_S = 5.0  # on shutdown, how long the running generation may go on before it is cancelled


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
        raise LeverError(f"lever serve needs the serve extra: pip install 'lever[serve]' "
                         f"({e.name} is missing)") from None
    from lever.api import load

    llm = load(args.config or shipped("default.toml"), overrides=args.set)
    try:
        model_id = Path(llm.config.model.target).stem
        asgi = app(llm, model_id=model_id, queue=args.queue)
        server = _server_class()(uvicorn.Config(asgi, host=args.host, port=args.port, log_level="warning",
                                                access_log=False))

        def stop(signum: int) -> None:  # INT, TERM or HUP: stop listening, drain, then cancel
            server.should_exit = True
            asgi.state.server.shutdown(GRACE_S)

        print(f"lever serve: http://{args.host}:{args.port}/v1 ({model_id}, {llm.config.pipeline.kind}), "
              f"queue {args.queue}", file=sys.stderr, flush=True)
        with signals.on_stop(stop):
            server.run()
    finally:
        llm.close()
    if (s := signals.pending()) is not None:
        raise signals.Interrupted(s)  # the command ends as every stopped command does: 128 + n
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its own signal handlers: lever.signals has INT, TERM and
        HUP (uvicorn would take two of them, and re-raise them after its shutdown)."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server
