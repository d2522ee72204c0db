"""The `lever` command: one parser over the subcommands, and how every one of them ends.

Each subcommand is a module of this package with `add_parser(sub)` and `main(args)`, a thin
layer over the library (as mlx-lm's commands are). However a command ends, it is one line on
stderr at most and an exit code that says how:
- a LeverError (or a missing file): `lever: error: ...`, exit 1, the traceback only under --debug;
- SIGINT, SIGTERM or SIGHUP, from the process's first instruction (lever.signals): cleanup,
  `lever: interrupted (SIGTERM)`, exit 128 + n; a second signal during cleanup is a forced quit;
- stdout closed before the start: refused before any work (what it would print would be lost);
- a reader that goes away (`lever run | head -3`): quiet, exit 141 (128 + SIGPIPE), as a C tool
  killed by SIGPIPE ends;
- stdout is Lever's output alone: what a native library prints goes to stderr (`_own_stdout`).
The heavy imports (numpy, the kernels, the commands) happen after the handlers are in place.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import gc
import importlib
import io
import os
import signal
import stat
import sys
import traceback

from lever import signals

COMMANDS = ("run", "generate", "chat", "inspect", "logits", "calibrate", "profile", "convert", "bench", "serve",
            "pull", "list")
EPILOG = ("INT, TERM and HUP stop any command cleanly (exit 128 + the signal's number); a second one while it "
          "cleans up quits at once, leaving temp files for the next run to remove.")
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    from lever.cli.common import lever_version, usage_error

    parser = argparse.ArgumentParser(prog="lever", description="Flash-resident speculative decoding of LLMs.",
                                     epilog=EPILOG)
    parser.error = functools.partial(usage_error, parser)  # an unknown command or flag: one line too
    parser.add_argument("--version", action="version", version=f"lever {lever_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"lever.cli.{name}").add_parser(sub)
    return parser


def entry() -> None:
    """The console script and `python -m lever`: the handlers stay for the interpreter's exit
    (a signal while it joins threads is remembered, a second one forces the quit)."""
    signals.install()
    _own_stdout()
    sys.exit(main())


def _own_stdout() -> None:
    """Keep stdout for Lever's own output: `sys.stdout` moves to a copy of descriptor 1, and 1
    itself to stderr's file, so whatever a native library prints (a QNN runtime's log line)
    reaches stderr and `lever run --json` stays one JSON object. Children Lever starts have
    their stdout piped, never inherited."""
    try:
        fd = sys.stdout.fileno()
        os.fstat(fd)
        os.fstat(2)
    except (OSError, ValueError, AttributeError):  # closed or not a descriptor: _main reports it
        return
    old = sys.stdout
    old.flush()
    saved = os.dup(fd)  # not inherited by children (Python's descriptors are close-on-exec)
    os.dup2(2, fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(saved, "w"), encoding=old.encoding, errors=old.errors,
                                  line_buffering=old.line_buffering)


def main(argv: list[str] | None = None) -> int:
    """Run one command; in-process callers (tests) get their own signal handlers back after."""
    owner = not signals.installed()
    signals.install()
    try:
        return _main(argv)
    finally:
        if owner:
            signals.uninstall()
        else:
            signals.disarm()


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # only before install() took the signals, or not in the main thread
        return _interrupted(signal.SIGINT)
    if (s := signals.pending()) is not None:  # a signal during the imports: end before starting
        return _interrupted(s)
    if sys.stdout is None or not _is_open(sys.stdout):
        print("lever: error: stdout is closed: what this command prints would be lost "
              "(redirect it to a file or to /dev/null)", file=sys.stderr)
        return 1
    if hasattr(args, "set"):  # --mem stands for two --set values; the command line's own come after and win
        from lever.cli.common import mem_sets

        args.set[:0] = mem_sets(args)
    if args.threads and hasattr(args, "set"):  # a command with a config: --threads is its [runtime] threads
        args.set.append(f"runtime.threads={args.threads}")
    from lever.backends.cpu import native
    from lever.errors import LeverError

    signals.arm()
    try:
        with native.default_threads(args.threads):
            code = args.func(args)
        # flushed while armed: a reader that holds the output back no longer holds the exit, where
        # a signal would find no handler and the code would say 0 over a cut result
        sys.stdout.flush()
        return code
    except KeyboardInterrupt as e:
        _release(e)
        if _is_pipe(sys.stdout):  # what it had left to print waits in the buffer: the exit's flush
            _flush_or_quiet_stdout()  # would block on a reader that stopped reading, past the signal
        return _interrupted(getattr(e, "signum", signals.pending() or signal.SIGINT))
    except BrokenPipeError as e:
        _release(e)
        signals.disarm()
        _quiet_stdout()
        return BROKEN_PIPE_EXIT
    except LeverError as e:
        if args.debug:
            raise
        _release(e)
        return _fail(str(e))
    except OSError as e:
        if args.debug:
            raise
        _release(e)
        return _fail(f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e))
    finally:
        signals.disarm()


def _release(e: BaseException) -> None:
    """Drop what the failed command's frames still hold (models, mappings, descriptors) now: the
    tracebacks' frames and the exceptions refer to each other, so only the garbage collector
    would free them, at a moment of its choosing (an in-process caller goes on)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        todo += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]
    gc.collect()


def _interrupted(signum: int) -> int:
    _stderr_line(f"\nlever: interrupted ({signals.name(signum)})")
    return signals.exit_code(signum)


def _fail(message: str) -> int:
    _stderr_line(f"lever: error: {message}")
    return 1


def _stderr_line(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # stderr closed too: the exit code is all that is left
        pass


def _is_open(stream) -> bool:
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not backed by a descriptor (a caller's StringIO): it takes writes
        return True
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _is_pipe(stream) -> bool:
    try:
        mode = os.fstat(stream.fileno()).st_mode
        return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except (OSError, ValueError, AttributeError):  # a caller's StringIO, or closed
        return False


def _flush_or_quiet_stdout() -> None:
    """Give a reader that still reads what is left, without waiting on one that stopped: the
    flush goes through a non-blocking descriptor, and what the pipe does not take at once is
    dropped (stdout then points at /dev/null). An in-process caller's own prints go on after."""
    try:
        fd = sys.stdout.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except (OSError, ValueError, AttributeError):
        return
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        try:
            sys.stdout.flush()
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except (BlockingIOError, BrokenPipeError):  # the pipe is full, or its reader gone
        _quiet_stdout()
    except (OSError, ValueError):
        pass


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: after a broken pipe the interpreter's last flush would print
    'Exception ignored ... BrokenPipeError' on stderr."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    entry()
