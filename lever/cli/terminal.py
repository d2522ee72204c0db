"""The terminal end of `lever chat` (lever.cli.chat): lines in, the reply's notes out.

On a terminal the lines are edited with the stdlib's readline (arrow keys, history recalled with
up, kept in a bounded file under $XDG_STATE_HOME/lever or ~/.cache/lever), a line ending in `\\`
goes on on the next, and Ctrl-C drops the line being typed (at an empty prompt it stops the chat as
it stops any command: lever.signals). Notes about a reply (cancelled, cut) are dim, after the
reply on the same line. Piped in, a line is a turn and there are no prompts; notes are lines of
their own on stderr, so stdout holds the replies alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

import attrs

from lever import signals

HISTORY_LINES = 1000  # lines the history file keeps, newest last
PROMPT, MORE = "> ", "... "
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


class Dropped(KeyboardInterrupt):
    """Ctrl-C while a line was being typed: the line is dropped, the chat goes on."""


def history_file() -> Path:
    """Where the chat's history is kept: $XDG_STATE_HOME/lever (an absolute one, as XDG says),
    else ~/.cache/lever."""
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".cache"
    return base / "lever" / "chat_history"


@attrs.define
class Terminal:
    """Lines in (`read`) and notes out (`note`, `end_reply`); `close` keeps the history."""

    out: TextIO
    err: TextIO
    interactive: bool  # stdin is a terminal: prompts, lines that go on, notes for a person
    readline: object = None  # the readline module when it edits the lines (stdin and stdout terminals)
    history: Path | None = None
    _pending: list[str] = attrs.field(factory=list)  # lines of a turn that goes on (each ended with \)

    @classmethod
    def open(cls, stdin: TextIO, out: TextIO, err: TextIO) -> Terminal:
        if not stdin.isatty():
            return cls(out, err, interactive=False)
        # input() edits with readline only when sys.stdout is descriptor 1, a terminal: the
        # command keeps its own stdout elsewhere (lever.cli.main) and 1 writes to stderr's file
        term = sys.__stdout__
        if not out.isatty() or term is None or term.fileno() != 1 or not term.isatty():
            return cls(out, err, interactive=True)  # `lever chat > log`: prompts on stderr, no editing
        import readline

        path = history_file()
        readline.set_history_length(HISTORY_LINES)
        try:
            readline.read_history_file(path)
        except OSError:  # none yet, or unreadable: this chat starts one
            pass
        return cls(out, err, interactive=True, readline=readline, history=path)

    def read(self) -> str | None:
        """The next turn's text, or None at the end of input (Ctrl-D). A line ending in a
        backslash goes on on the next (on a terminal)."""
        self._pending = []
        while True:
            try:
                line = self._line(MORE if self._pending else PROMPT)
            except Dropped:
                self.err.write("\n")
                self._pending = []
                continue
            except EOFError:
                if self.interactive:
                    self.err.write("\n")
                return "\n".join(self._pending) if self._pending else None
            if self.interactive and line.endswith("\\"):
                self._pending.append(line[:-1])
                continue
            return "\n".join([*self._pending, line])

    def _line(self, prompt: str) -> str:
        if self.readline is not None:
            own, sys.stdout = sys.stdout, sys.__stdout__
            try:
                with signals.on_interrupt(self._drop):
                    return input(prompt)
            finally:
                sys.stdout = own
        if self.interactive:
            self.err.write(prompt)
            self.err.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.removesuffix("\n")

    def _drop(self) -> bool:
        """Ctrl-C at the prompt (from the signal handler): a line under way is dropped; at an
        empty prompt the chat stops."""
        if self.readline.get_line_buffer() or self._pending:
            raise Dropped
        return False

    def note(self, text: str) -> None:
        """A line about the chat (not the model's text), on stderr."""
        self.err.write(f"{self._dim(text)}\n")
        self.err.flush()

    def end_reply(self, note: str | None = None) -> None:
        """The reply's end: its newline on stdout, and a note about it (cancelled, cut) after it on
        the same line when both go to a terminal, else on a line of its own on stderr."""
        self.out.flush()
        if note and self.out.isatty() and self.err.isatty():
            self.err.write(f" {self._dim(note)}")
            self.err.flush()
            note = None
        self.out.write("\n")
        self.out.flush()
        if note:
            self.note(note)

    def _dim(self, text: str) -> str:
        if self.err.isatty() and not os.environ.get("NO_COLOR"):
            return f"{DIM}{text}{PLAIN}"
        return text

    def close(self) -> None:
        """Keeps the history (its newest HISTORY_LINES lines); a file that cannot be written is a note."""
        if self.readline is None or self.history is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history)
        except OSError as e:
            self.note(f"lever: the chat's history was not kept: {self.history}: {e.strerror or e}")
