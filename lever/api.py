"""Lever from Python: load a pipeline once, then generate, stream and chat through it.

    import lever
    with lever.load("examples/lever.toml", dram_budget=0.25) as llm:
        c = llm.generate("def fib(n):", max_tokens=64, stop=["\\n\\n"])
        for chunk in llm.stream("def fib(n):", max_tokens=64):
            print(chunk.text, end="")
        r = llm.chat([{"role": "user", "content": "Write quicksort in Python."}], max_tokens=128)

Every call runs the configured pipeline (lever.pipelines.engine.Engine: the target streamed
from flash, trees from the draft, lossless), with the models opened once by `load`. A call's
sampling arguments override the config's [generate] for that call only. Stop strings are
matched on the decoded text, across token boundaries, and never emitted; the pipeline stops
at the end of the pass that completed one. One generation runs at a time (the engine is a
phone's whole compute); calls from several threads queue on a lock.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from lever.config import KNOBS, Config, load_config
from lever.dataflow.messages import TokenLogprob
from lever.errors import LeverError
from lever.gguf.chat_template import ChatTemplate, Rendered, check_messages
from lever.gguf.identity import ModelIdentity
from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.model.grammar import Grammar
from lever.model.grammar_cache import GrammarCache
from lever.model.stop import StopReason
from lever.model.tool_calls import CallStream, ToolCall, parse_calls, plan
from lever.pipelines import saved_session
from lever.pipelines.compose import KVState, Request
from lever.pipelines.engine import Engine
from lever.pipelines.prefix_cache import MIN_REUSE_TOKENS, KVSnapshot, PrefixCache, shared
from lever.pipelines.result import RunResult
from lever.pipelines.watch import RunWatch, Watch
from lever.policy.memory import mem_overrides

MAX_STOP_STRINGS = 16  # as OpenAI's API bounds them (it allows 4); each is matched on every pass
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs bounds them

# load()'s keywords: each is one config key (the rest go through `overrides`, as --set does); the
# generation knobs by their call names (lever.config.KNOBS), as the [generate] defaults
ALIASES = {"target": "model.target", "draft": "model.draft", "n_ctx": "model.n_ctx", "kind": "pipeline.kind",
           "dram_budget": "flash.dram_budget", "policy": "tree_expand.policy", "threads": "runtime.threads",
           **{k.arg: f"generate.{k.key}" for k in KNOBS.values()}}
PATH_ALIASES = ("target", "draft")
# a call's keywords
CALL_ARGS = (*(k.arg for k in KNOBS.values()), "stop", "logprobs", "grammar", "json_schema", "cancel")

class Cancelled(LeverError):
    """A generation whose cancel event was set before it could start."""


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt, already in a session's KV caches: not prefilled again

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Completion:
    """One generation: its text (stop string excluded), tokens, why it ended, and its figures."""

    text: str
    tokens: tuple[int, ...]  # generated ids, up to the one that completed a stop string
    finish_reason: StopReason
    usage: Usage
    stats: RunResult  # the run's figures, as `lever run --json` prints them
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the call asked for `logprobs`
    tool_calls: tuple[ToolCall, ...] = ()  # a chat with `tools`: the calls in the reply (`text` is the rest)


@attrs.frozen
class Chunk:
    """A piece of a streamed generation: text now final, and how many tokens it took."""

    text: str
    n_tokens: int
    finish_reason: StopReason | None = None  # set on the last chunk only
    logprobs: tuple[TokenLogprob, ...] = ()  # of this chunk's tokens, when the call asked for `logprobs`
    usage: Usage | None = None  # the last chunk only, as the completion's
    stats: RunResult | None = None  # the last chunk only: the run's figures
    tool_calls: tuple[ToolCall, ...] = ()  # the last chunk only, of a chat with `tools`: the reply's calls


@attrs.define
class StopStrings:
    """The stop rule of one generation (lever.stages.accept.StopRule): decodes the tokens each
    pass emits, ends the generation when the text holds a stop string or the caller cancelled,
    and hands on the text that no stop string can still claim (`on_text(text, n_tokens,
    logprobs)`), with the logprobs of the tokens it covers when the generation computes them."""

    tok: Tokenizer
    stops: tuple[str, ...] = ()
    on_text: object = None  # callable(text, n_tokens) or None
    eos_ids: frozenset[int] = frozenset()
    cancel: threading.Event = attrs.field(factory=threading.Event)
    text: str = ""  # everything decoded, stop string included
    sent: int = 0  # chars of `text` handed on
    tokens: list[int] = attrs.field(factory=list)  # ids kept: past a stop string, none
    logprobs: list[TokenLogprob] = attrs.field(factory=list)  # of `tokens`, when the run computes them
    unsent_tokens: int = 0
    stopped_at: int = -1  # where the first stop string starts in `text`
    # under a grammar, a stop string ends the text only where the grammar accepts what comes
    # before it: a reply that stops is one the grammar accepts, as one that ends by EOS is
    grammar: Grammar | None = None
    _ends: list[int] = attrs.field(factory=list)  # len(text) after each of `tokens`
    _decoder: StreamDecoder = attrs.field(init=False)

    def __attrs_post_init__(self):
        self._decoder = StreamDecoder(self.tok, at_start=False)

    def __call__(self, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()) -> StopReason | None:
        for i, t in enumerate(tokens):
            if self.stopped_at >= 0:
                break
            self.tokens.append(t)
            if logprobs:
                self.logprobs.append(logprobs[i])
            self.unsent_tokens += 1
            before = len(self.text)
            if t not in self.eos_ids:  # the end-of-turn token is not text
                self.text += self._decoder.push(t)
            self._ends.append(len(self.text))
            self._find(before)
        if self.stopped_at >= 0:
            self._hand_on(self.stopped_at)
            return StopReason.STOP
        self._hand_on(len(self.text) - self._held())
        return StopReason.CANCELLED if self.cancel.is_set() else None

    def finish(self) -> None:
        """The generation ended (not by a stop string): what was held back is final."""
        if self.stopped_at < 0:
            before = len(self.text)
            self.text += self._decoder.flush()
            self._find(before)
        self._hand_on(self.stopped_at if self.stopped_at >= 0 else len(self.text))

    @property
    def final_text(self) -> str:
        return self.text[: self.stopped_at] if self.stopped_at >= 0 else self.text

    def _find(self, before: int) -> None:
        """A match must end in the text added after `before` chars: it starts at most the
        longest stop string's length - 1 before them."""
        lo = max(0, before - max((len(s) for s in self.stops), default=0) + 1)
        hits = sorted(i for s in self.stops for i in _occurrences(self.text, s, lo))
        self.stopped_at = next((i for i in hits if self._ends_here(i)), -1)

    def _ends_here(self, at: int) -> bool:
        """Whether the text may end before `at` chars: always without a grammar; under one, at
        a token boundary where the grammar accepts the tokens before it."""
        if self.grammar is None:
            return True
        k = next((k for k, end in enumerate(self._ends) if end == at), None)  # the first: pending bytes are after
        return k is not None and self.grammar.accepts(self.tokens[: k + 1] if at else [])

    def _held(self) -> int:
        """Chars at the end of the text that begin a stop string: not final yet."""
        for n in range(min(len(self.text), max((len(s) for s in self.stops), default=0)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _hand_on(self, upto: int) -> None:
        if upto > self.sent or (self.unsent_tokens and self.stopped_at >= 0):
            if self.on_text is not None:
                lps = tuple(self.logprobs[len(self.tokens) - self.unsent_tokens :]) if self.logprobs else ()
                self.on_text(self.text[self.sent : max(upto, self.sent)], self.unsent_tokens, lps)
            self.sent, self.unsent_tokens = max(upto, self.sent), 0


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
        raise LeverError(f"stop: must be a string or a list of strings, got {type(stop).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise LeverError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise LeverError(f"stop: each string must be 1-{MAX_STOP_CHARS} characters, got {s!r:.40}")
    return tuple(stops)


def _occurrences(text: str, s: str, lo: int) -> Iterator[int]:
    i = text.find(s, lo)
    while i >= 0:
        yield i
        i = text.find(s, i + 1)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise LeverError(f"{value!r} is not a finite number")
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise LeverError(f"{value!r}: expected a number, a bool or a string")


def load(config: str | os.PathLike | None = None, *, overrides: Sequence[str] = (), chat_template: str | None = None,
         **settings) -> LLM:
    """Opens a pipeline: from a config file, or from settings alone (target=..., draft=...).

    `settings` are the common keys by short name (ALIASES: target, draft, dram_budget, n_ctx,
    kind, policy, threads, and the [generate] defaults), and `mem` ("2G", or bytes) as `--mem`
    takes it: [memory] limit, with the target's resident layers filling what the rest leaves
    (a dram_budget given too wins); `overrides` any "section.key=value" as `--set` takes them.
    Paths given here resolve against the working directory."""
    mem = settings.pop("mem", None)
    sets = [] if mem is None else mem_overrides(mem)
    for name, value in settings.items():
        if name not in ALIASES:
            raise LeverError(f"lever.load: unknown setting {name!r} (known: mem, {', '.join(ALIASES)}, "
                             f"or overrides=[...])")
        if name in PATH_ALIASES and value:
            value = str(Path(value).expanduser().resolve())
        sets.append(f"{ALIASES[name]}={_toml(value)}")
    if config is None and "kind" not in settings:  # no file: speculative with a draft, else Flash-AR
        sets.insert(0, 'pipeline.kind="speculative"' if settings.get("draft") else 'pipeline.kind="flash-ar"')
    cfg = load_config(config, [*sets, *overrides])
    return LLM(cfg, Engine.open(cfg, grammars=True), chat_template)  # structured output is in the plan


@attrs.define
class LLM:
    """An open pipeline. Close it (or use `with`) to release the target's file and buffers."""

    config: Config
    engine: Engine
    chat_template_text: str | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _template: ChatTemplate | None = None
    grammars: GrammarCache = attrs.field(init=False)  # compiled grammars, bounded by bytes (lever.model.grammar_cache)
    watch: Watch | None = None  # sees every generation's cycles as they run (a live page: lever.pipelines.watch)

    def __attrs_post_init__(self):
        self.grammars = GrammarCache(self.engine.tok)  # its compiler's child starts with the first grammar

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tok

    @property
    def busy(self) -> bool:
        """A generation is running (the others wait on the lock)."""
        return self._lock.locked()

    @property
    def chat_template(self) -> ChatTemplate:
        """The code's template, else the target GGUF's; a clear error when there is neither."""
        if self._template is None:
            tok = self.engine.tok
            bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
            eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
            if self.chat_template_text is not None:
                self._template = ChatTemplate(self.chat_template_text, "chat_template", bos, eos)
            elif self.config.model.chat_template:
                self._template = ChatTemplate(self.config.model.chat_template,
                                              f"{self.config.where}: [model] chat_template", bos, eos)
            else:
                self._template = ChatTemplate.from_gguf(self.engine.plan.target_file, bos, eos)
        return self._template

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], rendered: Rendered | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a conversation: the template's special tokens as control tokens,
        special-token text inside a message as the text it is (no user can forge a turn).
        `rendered`: the conversation already rendered (a server renders in a child process);
        `tools`: the functions the template offers (checked)."""
        if rendered is None:
            rendered = self.chat_template.render_marked(messages, specials=tuple(self.engine.tok.specials),
                                                        tools=tools)
        # the template writes its own special tokens, a leading BOS among them
        return self.engine.tok.encode_chat(rendered) or _empty()

    def generate(self, prompt: str, **sampling) -> Completion:
        """A completion of `prompt`; `sampling`: the generation knobs by their call names
        (lever.config.KNOBS: max_tokens, temperature, top_k, ...), `stop` strings, `logprobs`
        (alternatives per token), a `grammar` (Lark or llama.cpp's GBNF text, or a
        lever.model.grammar.Grammar) or a `json_schema` (a dict) the text must follow, a `cancel` event."""
        return self.complete(self.encode_prompt(prompt), sampling)

    def stream(self, prompt: str, **sampling) -> Iterator[Chunk]:
        """The completion as it is decoded: each chunk's text is final (stop strings held back
        until they cannot match, UTF-8 never split). Leaving the loop early cancels the
        generation at the end of its current pass."""
        return self.stream_ids(self.encode_prompt(prompt), sampling)

    def chat(self, messages: Sequence[dict], *, tools: list[dict] | None = None, tool_choice=None,
             **sampling) -> Completion:
        """The assistant's reply to `messages`, through the chat template. With `tools` (OpenAI's
        function definitions) the template offers them and the reply's calls come back parsed
        (`Completion.tool_calls`, lever.model.tool_calls); `tool_choice` "required" or a named
        function makes the reply a call, enforced by a grammar; "none" offers no tools."""
        shown, sampling = self.tools(tools, tool_choice, sampling)
        c = self.complete(self.encode_chat(messages, tools=shown), sampling)
        return with_tool_calls(c, shown)

    def stream_chat(self, messages: Sequence[dict], *, tools: list[dict] | None = None, tool_choice=None,
                    **sampling) -> Iterator[Chunk]:
        """`chat`, streamed: with `tools`, text streams until a call may begin and the calls come
        whole on the last chunk (`Chunk.tool_calls`)."""
        shown, sampling = self.tools(tools, tool_choice, sampling)
        return with_call_stream(self.stream_ids(self.encode_chat(messages, tools=shown), sampling), shown)

    def tools(self, tools: list[dict] | None, tool_choice, sampling: dict) -> tuple[list[dict] | None, dict]:
        """The functions the template offers (checked; None: none) and the sampling arguments
        with the grammar a required or named call brings (lever.model.tool_calls.plan;
        `parallel_tool_calls=False` among them: exactly one call)."""
        sampling = dict(sampling)
        parallel = sampling.pop("parallel_tool_calls", True)
        shown, grammar = plan(self.engine.tok, tools, tool_choice, parallel is not False)
        if grammar is not None:
            if sampling.get("grammar") is not None or sampling.get("json_schema") is not None:
                raise LeverError("tool_choice: a required call is its own grammar; drop grammar / json_schema "
                                 "(response_format)")
            sampling = {**sampling, "grammar": grammar}
        return shown, sampling

    def close(self) -> None:
        self.grammars.close()  # a compile under way (a server's request thread) fails at once
        with self._lock:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one generation

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise LeverError(f"prompt: must be a string, got {type(text).__name__}")
        tok = self.engine.tok
        if chat:  # the template writes its own special tokens, a leading BOS among them
            return tok.encode(text, add_bos=False) or _empty()
        return self.engine.encode(text)

    def grammar(self, sampling: dict) -> Grammar | None:
        """The call's `grammar` or `json_schema`, compiled for this tokenizer (one line naming
        the argument when it is not one); compiled grammars are kept, so a server's repeated
        schema is checked once."""
        return self.grammars.get(sampling.get("grammar"), sampling.get("json_schema"))

    def check(self, sampling: dict, n_prompt: int):
        """A call's arguments as this call's [generate], stop strings and cancel event; one line
        naming the argument at fault."""
        unknown = [k for k in sampling if k not in CALL_ARGS]
        if unknown:
            raise LeverError(f"unknown argument {unknown[0]!r} (known: {', '.join(CALL_ARGS)})")
        changes = {}
        for k in KNOBS.values():  # a call's bounds: [generate]'s, max_tokens stricter (a call asks for a token)
            v = sampling.get(k.arg)
            if v is None:
                continue
            problem = k.call.problem(v)
            if problem is not None:
                raise LeverError(f"{k.arg}: {problem}")
            changes[k.key] = int(v) if k.call.integer else float(v)
        gen = attrs.evolve(self.config.generate, **changes)
        logprobs = sampling.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise LeverError(f"logprobs: must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), "
                             f"got {logprobs!r}")
        n_ctx, where = self.engine.n_ctx, self.engine.n_ctx_source
        if n_prompt >= n_ctx:  # the prompt alone: no max_tokens would help
            raise LeverError(f"prompt: {n_prompt} tokens, over the context of {n_ctx} ({where})")
        if n_prompt + gen.n_predict > n_ctx:
            raise LeverError(f"max_tokens: {gen.n_predict} tokens after a prompt of {n_prompt} pass the context of "
                             f"{n_ctx} ({where})")
        return gen, _stops(sampling.get("stop")), sampling.get("cancel")

    def session(self) -> Session:
        """A conversation whose text stays in both KV caches between calls (lever.api.Session)."""
        return Session(self)

    def complete(self, ids: list[int], sampling: dict, on_text=None, session: Session | None = None,
                 client: object = None) -> Completion:
        """A generation from prompt ids (`on_text(text, n_tokens, logprobs)`: each piece as it is final);
        in `session`, the prefix its caches already hold is not prefilled again, when the
        session's last call was `client`'s (a server's clients never share a prefix)."""
        gen, stops, cancel = self.check(sampling, len(ids))
        logprobs, grammar = sampling.get("logprobs"), self.grammar(sampling)
        rule = StopStrings(self.engine.tok, stops, on_text, frozenset(self.engine.tok.eos_ids),
                           cancel if cancel is not None else threading.Event(), grammar=grammar)
        with self._lock:
            if rule.cancel.is_set():  # its caller left while it waited
                raise Cancelled("the generation was cancelled before it started")
            watch = self.watch.run(client) if self.watch is not None else None
            if session is None:
                res, cached = self.engine.run(Request(ids, gen, rule, logprobs=logprobs, grammar=grammar,
                                                      watch=watch)), 0
            else:
                session.switch(ids, client)
                res, cached = session.run(ids, gen, rule, logprobs, grammar, watch=watch)
        rule.finish()
        reason = StopReason.STOP if rule.stopped_at >= 0 else res.stop_reason or StopReason.LENGTH
        tokens = tuple(rule.tokens)
        return Completion(rule.final_text, tokens, reason, Usage(len(ids), len(tokens), cached), res,
                          tuple(rule.logprobs) if logprobs is not None else None)

    def stream_ids(self, ids: list[int], sampling: dict, session: Session | None = None,
                   client: object = None) -> Iterator[Chunk]:
        self.check(sampling, len(ids))  # a bad argument fails here, at the call, not at the first next()
        self.grammar(sampling)
        out: queue.Queue = queue.Queue()
        cancel = sampling.get("cancel") or threading.Event()
        done = object()

        def piece(text: str, n_tokens: int, logprobs: tuple[TokenLogprob, ...]) -> None:
            out.put(Chunk(text, n_tokens, logprobs=logprobs))

        def work():
            try:
                out.put(self.complete(ids, {**sampling, "cancel": cancel}, piece, session, client))
            except BaseException as e:  # handed to the consumer, raised there
                out.put(e)
            finally:
                out.put(done)

        def chunks() -> Iterator[Chunk]:
            worker = threading.Thread(target=work, name="lever-generate", daemon=True)
            worker.start()
            try:
                while (item := out.get()) is not done:
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, Completion):
                        yield Chunk("", 0, item.finish_reason, usage=item.usage, stats=item.stats)
                    elif item.text or item.n_tokens:
                        yield item
            finally:
                cancel.set()  # a consumer that left early ends the generation at its next pass
                worker.join()

        return chunks()


@attrs.define
class Session:
    """A conversation kept in both models' KV caches between calls: each call's prompt is the
    whole text (a chat's whole conversation, rendered again), and the prefix the caches already
    hold is not prefilled again, so a second turn prefills only its new tokens. Editing or
    dropping messages (`rewind`) just makes that prefix shorter. The caches live as long as the
    session: one pair, the size the memory plan gives a run."""

    llm: LLM
    messages: list[dict] = attrs.field(factory=list)  # the conversation so far, replies included
    ids: list[int] = attrs.field(factory=list)  # the text both caches hold, token by token
    kv: KVState | None = None
    last_cached: int = 0  # prompt tokens the last call took from the caches
    client: object = None  # whose text the caches hold (a server's API key; None for every in-process call)
    cache: PrefixCache | None = None  # other conversations kept between calls (a server's); None: this one alone

    @property
    def n_cached(self) -> int:
        return self.kv.n_rows if self.kv is not None else 0

    def generate(self, prompt: str, **sampling) -> Completion:
        """A completion of `prompt`, the session's whole text so far (not only what is new)."""
        return self.llm.complete(self.llm.encode_prompt(prompt), sampling, session=self)

    def stream(self, prompt: str, **sampling) -> Iterator[Chunk]:
        return self.llm.stream_ids(self.llm.encode_prompt(prompt), sampling, session=self)

    def chat(self, messages: Sequence[dict], *, tools: list[dict] | None = None, tool_choice=None,
             **sampling) -> Completion:
        """The reply to the conversation with `messages` added; the reply joins it (its tool
        calls too, as an assistant message with `tool_calls`, which the template renders back).
        `tools` and `tool_choice` as LLM.chat's, for this call: give them on every call that
        offers them, as an OpenAI client does (the rendered text, and so the reused prefix, has them)."""
        shown, sampling = self.llm.tools(tools, tool_choice, sampling)
        ids = self._turn(messages, shown)
        c = self.llm.complete(ids, sampling, session=self)
        c = with_tool_calls(c, shown)
        self.messages.append(_reply(c.text, c.tool_calls))
        return c

    def stream_chat(self, messages: Sequence[dict], *, tools: list[dict] | None = None, tool_choice=None,
                    **sampling) -> Iterator[Chunk]:
        shown, sampling = self.llm.tools(tools, tool_choice, sampling)
        ids = self._turn(messages, shown)
        text = []
        for chunk in with_call_stream(self.llm.stream_ids(ids, sampling, session=self), shown):
            text.append(chunk.text)
            if chunk.finish_reason is not None:
                self.messages.append(_reply("".join(text), chunk.tool_calls))
            yield chunk

    def rewind(self, n_messages: int) -> None:
        """Keeps the first n_messages of the conversation (to edit the last one, rewind past it
        and chat again); the caches keep what the shorter text still shares with them."""
        if not 0 <= n_messages <= len(self.messages):
            raise LeverError(f"rewind: n_messages must be in [0, {len(self.messages)}], got {n_messages}")
        del self.messages[n_messages:]

    def reset(self) -> None:
        self.messages.clear()
        self.ids, self.kv = [], None

    def switch(self, ids: list[int], client: object) -> None:
        """Before a call of `client` with prompt `ids` (under the LLM's lock): the caches should
        hold that client's conversation sharing the most with `ids`. Another client's text is
        never reused; with a prefix cache, the conversation leaving is kept there and a better
        one of this client's comes back from it (lever.pipelines.prefix_cache)."""
        same = self.client == client
        live = shared(self.ids, ids) if same and self.kv is not None else 0
        back = self.cache.take(client, ids, at_least=live) if self.cache is not None else None
        # the live conversation leaves, or the call would cut much of it: keep a copy first
        leaving = back is not None or not same or len(self.ids) - live > MIN_REUSE_TOKENS
        if self.cache is not None and self.kv is not None and self.ids and leaving:
            self.cache.put(self.client, KVSnapshot.of(self.kv, self.ids))
        if back is not None:
            if self.kv is None:
                self.kv = self.llm.engine.new_kv()
            back.restore(self.kv)
            self.messages.clear()
            self.ids, self.client = list(back.ids), client
        elif not same:
            self.reset()
            self.client = client
        # else: this client's live conversation shares the most; the run keeps what it shares

    def close(self) -> None:
        self.reset()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save(self, path: str | os.PathLike) -> None:
        """The conversation and the caches' rows, to msgpack (lever.pipelines.saved_session)."""
        with self.llm._lock:
            saved_session.write(path, messages=self.messages, ids=self.ids, kv=self.kv, **self._identities())

    def load(self, path: str | os.PathLike) -> None:
        """A saved session of the same model pair: its conversation goes on from its caches."""
        with self.llm._lock:
            kv = self.llm.engine.new_kv()
            messages, ids = saved_session.read(path, kv=kv, n_vocab=self.llm.engine.plan.spec.n_vocab,
                                               **self._identities())
            self.messages, self.ids, self.kv = messages, ids, kv

    def _identities(self) -> dict[str, ModelIdentity | None]:
        """The pair's files, which a saved session is tied to (the draft's when it runs)."""
        p = self.llm.engine.plan
        return {"target": ModelIdentity.of(p.target_file.path),
                "draft": ModelIdentity.of(p.draft_file.path) if p.draft_file is not None else None}

    def _turn(self, messages: Sequence[dict], tools: list[dict] | None = None) -> list[int]:
        added = check_messages(messages) if messages else []
        ids = self.llm.encode_chat(self.messages + added, tools=tools)
        self.messages.extend(added)
        return ids

    def run(self, ids: list[int], gen, rule, logprobs: int | None = None, grammar: Grammar | None = None,
            watch: RunWatch | None = None) -> tuple[RunResult, int]:
        """The engine's run of `ids` from what the caches share with it (called under the
        LLM's lock). Returns the run and how many prompt tokens came from the caches."""
        # at least one token is prefilled: its logits start the reply
        common = min(shared(ids, self.ids[: self.n_cached]), len(ids) - 1)
        kv, kept = self.kv, []
        if kv is not None:
            kv.truncate(common)
        self.ids, self.kv = [], None  # until the run ends well, the caches are in flux
        res = self.llm.engine.run(Request(ids[common:], gen, rule, kv=kv, history=ids[:common], logprobs=logprobs,
                                          grammar=grammar, watch=watch), on_kv=kept.append)
        self.kv = kept[0]
        self.ids = (ids + res.tokens)[: self.kv.n_rows]
        self.last_cached = common
        return res, common


def with_tool_calls(c: Completion, tools: Sequence[dict] | None) -> Completion:
    """The completion with the calls of the functions `tools` offers parsed out of its text
    (lever.model.tool_calls); None: no tools, the completion as it is."""
    if not tools:
        return c
    text, calls = parse_calls(c.text, _names(tools))
    return attrs.evolve(c, text=text, tool_calls=tuple(calls))


def with_call_stream(chunks: Iterator[Chunk], tools: Sequence[dict] | None) -> Iterator[Chunk]:
    """A stream whose text stops where a tool call may begin; the last chunk carries the rest
    of the text and the calls of the functions `tools` offers (lever.model.tool_calls.CallStream)."""
    if not tools:
        yield from chunks
        return
    calls = CallStream(_names(tools))
    for chunk in chunks:
        text = calls.push(chunk.text)
        if chunk.finish_reason is not None:
            rest, found = calls.finish()
            text += rest
            chunk = attrs.evolve(chunk, tool_calls=tuple(found))
        yield attrs.evolve(chunk, text=text)


def _names(tools: Sequence[dict]) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools)


def _reply(text: str, calls: tuple[ToolCall, ...]) -> dict:
    """The assistant's message of a reply, as the conversation keeps it."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": [tc.as_openai() for tc in calls]}


def _empty():
    raise LeverError("empty prompt")
