"""`lever chat [-c CONFIG | -m TARGET.gguf [-md DRAFT.gguf]]`: a terminal conversation through a pipeline.

Each line you type is a user turn; the reply streams as it is decoded, through the target's
chat template, in a session whose KV caches keep the conversation (a turn prefills only its
own tokens). `/set NAME VALUE` changes a knob for the replies after it (`/set n 64`), `/reset`
starts over, `/save FILE` writes the session (conversation and caches) and `/load FILE` reads
one back, `/exit` or end of input (Ctrl-D) leaves. The terminal side, line editing and history,
is lever.cli.terminal.

Ctrl-C during a reply cancels that reply only: it ends at the end of the pass under way, marked
`[cancelled]`, and the conversation keeps what was shown of it (a reply cancelled before its
first word is dropped with its turn); a second Ctrl-C before it ended stops the chat. A reply is
fitted to the room the context has left, and one cut by its token limit is marked with that limit.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import attrs

from lever import signals
from lever.cli.common import add_common, add_knobs, add_set, check_sets, knob_values
from lever.cli.models import add_models, check_models, config_and_sets
from lever.cli.terminal import Terminal
from lever.config import KNOBS
from lever.errors import LeverError
from lever.model.stop import StopReason
from lever.outputs import writable_destination

HELP = "/set NAME VALUE · /reset · /save FILE · /load FILE · /exit; Ctrl-C stops a reply, Ctrl-D leaves"


def add_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("chat", help="a terminal chat through the configured pipeline, streamed")
    add_models(c)
    c.add_argument("--system", default=None, help="a system message to start the conversation with")
    add_knobs(c, "n_predict", "temperature", "seed", defaults={"n_predict": 256}, call=True)  # -n: per reply
    add_set(c)
    add_common(c)
    c.set_defaults(func=main, check=check_args)
    return c


def check_args(args) -> None:
    check_models(args)
    check_sets(args)


def main(args) -> int:
    check_args(args)
    from lever.api import load

    config, model_sets = config_and_sets(args)
    with load(config, overrides=[*model_sets, *args.set]) as llm:
        if (note := llm.chat_template.note) is not None:  # a template that cannot be read fails here, before a turn
            print(f"lever chat: {note}", file=sys.stderr, flush=True)  # the GGUF has none: llama-server's ChatML
        sampling = {KNOBS[key].arg: v for key, v in knob_values(args).items()}
        term = Terminal.open(sys.stdin, sys.stdout, sys.stderr)
        try:
            with llm.session() as s:
                chat = Chat(llm, s, term, sampling=sampling, system=args.system)
                chat.start()
                if term.interactive:
                    term.note(f"lever chat ({Path(llm.config.model.target).stem}); {HELP}")
                while (text := term.read()) is not None and chat.take(text):
                    pass
        finally:
            term.close()
    return 0


@attrs.define
class Chat:
    """One chat: its session, the knobs its replies take (the flags', then /set's), its system message."""

    llm: object  # lever.api.LLM
    session: object  # lever.api.Session
    term: Terminal
    sampling: dict  # call arguments by their call names (max_tokens, temperature, ...)
    system: str | None = None

    def start(self) -> None:
        self.session.reset()
        if self.system:
            self.session.messages.append({"role": "system", "content": self.system})

    def take(self, line: str) -> bool:
        """One line typed: a command or a turn. False: the chat ends."""
        text = line.strip()
        if not text:
            return True
        if not text.startswith("/"):
            self.reply(text)
            return True
        cmd, _, arg = text.partition(" ")
        if cmd == "/exit":
            return False
        try:  # a wrong name or value is one line; the conversation goes on
            self.command(cmd, arg.strip())
        except LeverError as e:
            self.term.note(f"lever: error: {e}")
        return True

    def command(self, cmd: str, arg: str) -> None:
        s = self.session
        if cmd == "/reset":
            self.start()
            self.term.note("(the conversation starts over)")
        elif cmd == "/set":
            self.term.note(self.set_knob(arg) if arg else self.knobs())
        elif cmd == "/save" and arg:
            s.save(writable_destination(arg, "/save"))
            self.term.note(f"(saved {len(s.messages)} messages, {s.n_cached} cached tokens to {arg})")
        elif cmd == "/load" and arg:
            s.load(arg)
            self.term.note(f"(loaded {len(s.messages)} messages, {s.n_cached} cached tokens)")
        else:
            self.term.note(f"(unknown command {cmd!r}; {HELP})")

    def set_knob(self, arg: str) -> str:
        """`/set NAME VALUE`: a knob by its flag, [generate] key or call name, bounded as a call's."""
        name, _, value = arg.partition(" ")
        k = next((k for k in KNOBS.values() if name in (k.flag, k.key, k.arg)), None)
        if k is None:
            raise LeverError(f"/set: no knob {name!r} (knobs: {', '.join(k.flag for k in KNOBS.values())})")
        try:
            v = int(value.strip(), 10) if k.call.integer else float(value)
        except ValueError:
            raise LeverError(f"/set {name}: expected {'an integer' if k.call.integer else 'a number'}, "
                             f"got {value.strip()[:40]!r}") from None
        problem = k.call.problem(v)
        if problem is not None:
            raise LeverError(f"/set {name}: {problem}")
        self.sampling[k.arg] = v
        return f"({k.flag} = {_shown(v)})"

    def knobs(self) -> str:
        g = self.llm.config.generate
        return "(" + " · ".join(f"{k.flag} {_shown(self.sampling.get(k.arg, getattr(g, k.key)))}"
                                for k in KNOBS.values()) + ")"

    def reply(self, text: str) -> None:
        """One turn: the reply streamed to stdout, then how it ended when that is worth a note."""
        from lever.api import Cancelled

        s, n_before, cancel = self.session, len(self.session.messages), threading.Event()

        def take() -> bool:  # a first Ctrl-C cancels the reply; a second one, before it ended, stops the chat
            if cancel.is_set():
                return False
            cancel.set()
            return True

        turn, shown, end = [{"role": "user", "content": text}], [], None
        try:
            with signals.on_interrupt(take):
                args, fitted = self.fit(turn)
                for chunk in s.stream_chat(turn, cancel=cancel, **args):
                    self.term.out.write(chunk.text)
                    self.term.out.flush()
                    shown.append(chunk.text)
                    end = chunk if chunk.finish_reason is not None else end
        except Cancelled:  # before the run began
            s.rewind(n_before)
            self.term.note("[cancelled before the reply began: the turn is dropped]")
            return
        except LeverError as e:  # one bad turn (too long, a template that fails) does not end the chat
            s.rewind(n_before)
            if shown:
                self.term.end_reply()
            self.term.note(f"lever: error: {e}")
            return
        if end.finish_reason == StopReason.CANCELLED and not "".join(shown):
            s.rewind(n_before)  # nothing was shown: the conversation keeps nothing of the turn
            self.term.end_reply("[cancelled before the reply began: the turn is dropped]")
            return
        self.term.end_reply(self.ending(end, fitted))

    def fit(self, turn: list[dict]) -> tuple[dict, bool]:
        """The call's arguments, its max_tokens within the room the context has left after the
        conversation (True when that room cut it); a conversation that fills the context is
        refused by the call, naming the prompt."""
        n = self.sampling.get("max_tokens", self.llm.config.generate.n_predict)
        room = self.llm.n_ctx - len(self.llm.encode_chat(self.session.messages + turn))
        if 1 <= room < n:
            return {**self.sampling, "max_tokens": room}, True
        return self.sampling, False

    def ending(self, end, fitted: bool) -> str | None:
        """The note on how a reply ended, when it did not end by itself."""
        n = end.usage.completion_tokens if end.usage is not None else 0
        if end.finish_reason == StopReason.CANCELLED:
            return "[cancelled]"
        if end.finish_reason == StopReason.CONTEXT or (end.finish_reason == StopReason.LENGTH and fitted):
            return f"[cut at {n} tokens: the context ({self.llm.n_ctx} tokens) is full; /reset starts over]"
        if end.finish_reason == StopReason.LENGTH:
            return f"[cut at {n} tokens: /set n N or -n N for longer replies]"
        return None


def _shown(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
