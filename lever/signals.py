"""Terminating signals for the `lever` command: INT, TERM and HUP all stop it the way Ctrl-C does.

The command (lever.cli.main) installs these handlers before its heavy imports, and each stop
takes one of three paths, by when the signal lands:
- before the command starts (imports, argument parsing): it is remembered, and the command
  ends without starting (`pending()`); raising in the middle of an import would leave
  half-built modules and a traceback;
- while it runs: the innermost registered stop callback runs (`on_stop`: a pipeline cancels
  its task group, as asyncio's runner does on Ctrl-C; the server drains), or without one an
  `Interrupted` (a KeyboardInterrupt) is raised in the main thread, so every `finally` runs
  (threads joined, temp files removed, mappings closed);
- a second signal while that cleanup runs is the documented forced quit: one line and
  `os._exit(128 + n)` at once, with no cleanup (what a user pressing Ctrl-C twice asks for).
The exit code is 128 + the first signal's number, as a shell reports a process the signal killed.
A command that reads a terminal may take SIGINT as its own input instead (`on_interrupt`: `lever
chat` cancels the reply under way, or drops the line being typed): a Ctrl-C it takes is no stop
at all, and TERM and HUP stop it as any other.

Outside the command (tests, Python callers of lever.api) nothing is installed and `run_async`
is plain `anyio.run`, so asyncio's own Ctrl-C handling applies.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

TERMINATING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A terminating signal, raised in the main thread; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_installed: dict[int, object] = {}  # signal -> the handler it had before install()
_received: int | None = None  # the first terminating signal since install()
_armed = False  # the command is running: raise or call back instead of remembering
_callbacks: list = []  # stop callbacks, innermost last
_interrupts: list = []  # SIGINT's takers (on_interrupt), innermost last


def _handler(signum: int, frame) -> None:
    global _received
    if _received is not None:  # the second one: forced quit, no cleanup
        try:
            os.write(2, f"\nlever: forced quit ({signal.Signals(signum).name} during cleanup)\n".encode())
        finally:
            os._exit(128 + _received)
    # the command's own input when its taker says so (it may raise, to leave a blocking read)
    if signum == signal.SIGINT and _armed and _interrupts and _interrupts[-1]():
        return
    _received = signum
    if not _armed:
        return
    if _callbacks:
        _callbacks[-1](signum)
        return
    raise Interrupted(signum)


def install() -> None:
    """Take INT, TERM and HUP for this process (main thread only; undone by `uninstall`)."""
    global _received, _armed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _received, _armed = None, False
    for s in TERMINATING:
        _installed[s] = signal.signal(s, _handler)


def uninstall() -> None:
    global _received, _armed
    for s, previous in _installed.items():
        signal.signal(s, previous)
    _installed.clear()
    _received, _armed = None, False
    _callbacks.clear()
    _interrupts.clear()


def arm() -> None:
    """From here a signal stops the command (callback or Interrupted) instead of being remembered."""
    global _armed
    _armed = True


def disarm() -> None:
    """Back to remembering: the command is over (the interpreter's exit still joins threads)."""
    global _armed
    _armed = False
    _callbacks.clear()
    _interrupts.clear()


def pending() -> int | None:
    """The signal received so far, if any."""
    return _received


def installed() -> bool:
    return bool(_installed)


def exit_code(signum: int) -> int:
    return 128 + signum


def name(signum: int) -> str:
    return signal.Signals(signum).name


@contextmanager
def on_stop(callback):
    """While inside, the first signal calls `callback(signum)` (in the main thread, from the
    handler: it must only set flags or schedule work) instead of raising Interrupted."""
    with _registered(_callbacks, callback):
        yield


@contextmanager
def on_interrupt(taker):
    """While inside (the command running), SIGINT first asks `taker()` (in the main thread, from
    the handler): true, the command took it as its own input and goes on, nothing remembered; false,
    the ordinary stop. `taker` may raise instead, which takes the signal too: the exception leaves
    what the main thread was doing (a terminal read), as KeyboardInterrupt would."""
    with _registered(_interrupts, taker):
        yield


@contextmanager
def _registered(handlers: list, handler):
    """`handler` in `handlers` while inside; only where the handlers run (installed, main thread)."""
    if not _installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers.append(handler)
    try:
        yield
    finally:
        handlers.remove(handler)


def run_async(fn):
    """`anyio.run(fn)`; under the command a signal cancels the run's task (its task groups
    unwind, worker threads finish their call) and the run raises Interrupted, as asyncio's
    runner turns Ctrl-C into KeyboardInterrupt."""
    import asyncio

    import anyio

    if not _installed or threading.current_thread() is not threading.main_thread():
        return anyio.run(fn)

    async def main():
        task, loop = asyncio.current_task(), asyncio.get_running_loop()

        def stop(signum: int) -> None:
            task.cancel()
            loop.call_soon_threadsafe(lambda: None)  # wake a select() waiting on a long timeout

        with on_stop(stop):
            if early:  # it came while the loop was being built: the run ends before it starts
                return None
            return await fn()

    # a signal while the event loop is built or torn down is remembered, never raised there: raised
    # inside asyncio's loop constructor it left a half-built loop whose __del__ printed a traceback
    early: list[int] = []
    try:
        with on_stop(early.append):
            result = anyio.run(main)
    except asyncio.CancelledError:
        if _received is not None:
            raise Interrupted(_received) from None
        raise
    if _received is not None:  # the run finished in the same pass the signal landed
        raise Interrupted(_received)
    return result

