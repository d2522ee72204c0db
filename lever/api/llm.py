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
phone's whole compute), or [pipeline] parallel of them sharing the target's passes; calls
from more threads wait for a lane (lever.api.lanes).
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from lever.api.call import Call, Cancelled, Chunk, Completion, Offer, Usage, prepare_generate
from lever.api.conversation import Session
from lever.api.lanes import Lanes
from lever.api.render import ChatRenderer
from lever.config import KNOBS, Config, load_config
from lever.dataflow.messages import TokenLogprob
from lever.errors import LeverError
from lever.gguf.chat_template import ChatTemplate, Rendered
from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar_cache import GrammarCache
from lever.model.stop import StopReason
from lever.model.tool_calls import GENERIC, ToolFormat, detect, plan
from lever.pipelines.engine import Engine
from lever.pipelines.prefix_cache import PrefixCache
from lever.pipelines.residency import MemoryChange
from lever.pipelines.text import TextStream
from lever.pipelines.watch import Watch
from lever.policy.memory import MemoryPlan, mem_overrides

# load()'s keywords: each is one config key (the rest go through `overrides`, as --set does); the
# generation knobs by their call names (lever.config.KNOBS), as the [generate] defaults
ALIASES = {"target": "model.target", "draft": "model.draft", "n_ctx": "model.n_ctx", "kind": "pipeline.kind",
           "dram_budget": "flash.dram_budget", "policy": "tree_expand.policy", "threads": "runtime.threads",
           **{k.arg: f"generate.{k.key}" for k in KNOBS.values()}}
PATH_ALIASES = ("target", "draft")

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
         grammars: bool = True, **settings) -> LLM:
    """Opens a pipeline: from a config file, or from settings alone (target=..., draft=...).

    `settings` are the common keys by short name (ALIASES: target, draft, dram_budget, n_ctx,
    kind, policy, threads, and the [generate] defaults), and `mem` ("2G", or bytes) as `--mem`
    takes it: [memory] limit, with the target's resident layers filling what the rest leaves
    (a dram_budget given too wins); `overrides` any "section.key=value" as `--set` takes them.
    Paths given here resolve against the working directory. `grammars` false: no structured
    output, and no room for it in the memory plan (a call bringing a grammar is refused)."""
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
    # structured output in the plan, or off; the memory the system grants followed from before the layers load
    return LLM(cfg, Engine.open(cfg, grammars=grammars, follow=True), chat_template, structured=grammars)


@attrs.define
class LLM:
    """An open pipeline. Close it (or use `with`) to release the target's file and buffers."""

    config: Config
    engine: Engine
    chat_template_text: str | None = None
    _template: ChatTemplate | None = None
    # compiled grammars, bounded by bytes (lever.model.grammar_cache); its compiler's child starts with the first
    grammars: GrammarCache = attrs.field(init=False, default=attrs.Factory(lambda s: GrammarCache(s.engine.tok),
                                                                           takes_self=True))
    # every chat's template runs in its child (lever.api.render), started lazily
    renderer: ChatRenderer = attrs.field(init=False, default=attrs.Factory(
        lambda s: ChatRenderer(s.engine.tok, s.engine.n_ctx, s.engine.n_ctx_source,
                               reasoning=s.config.model.reasoning), takes_self=True))
    watch: Watch | None = None  # sees every generation's cycles as they run (a live page: lever.pipelines.watch)
    structured: bool = True  # structured output planned for (lever.load's `grammars`); off, a grammar is refused
    # [pipeline] parallel generations at once (lever.api.lanes)
    lanes: Lanes = attrs.field(init=False, default=attrs.Factory(
        lambda s: Lanes(s.engine.plan.parallel, s.engine.batcher() if s.engine.plan.parallel > 1 else None),
        takes_self=True))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tok

    @property
    def parallel(self) -> int:
        """Generations that run at once ([pipeline] parallel), their trees verified in shared passes."""
        return self.lanes.n

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

    @property
    def n_ctx(self) -> int:
        """The context a call's prompt and max_tokens share."""
        return self.engine.n_ctx

    @property
    def n_ctx_source(self) -> str:
        """Which limit sets the context ([model] n_ctx, or the target's own)."""
        return self.engine.n_ctx_source

    def set_memory(self, limit_bytes: int) -> MemoryChange:
        """The DRAM this pipeline may hold from now on, while generations run or not (what a
        phone's app does when the OS asks it to trim, or grants memory back): its resident layers
        are dropped at once or read back in the background to the most a plan within the limit
        holds. Below the run's floor (every layer streamed) a LeverError names the limit and the
        floor, and running generations stop with it at their next layer."""
        return self.engine.set_memory(limit_bytes)

    def memory_plan(self) -> MemoryPlan:
        """The memory plan of the largest call (a prompt filling the context): what a server
        holds its generations to."""
        return self.engine.memory_plan(self.n_ctx - 1)

    def encode_chat(self, messages: Sequence[dict], rendered: Rendered | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a conversation: the template's special tokens as control tokens,
        special-token text inside a message as the text it is (no user can forge a turn).
        Rendered in the renderer's child process, bounded in time, memory and output
        (lever.api.render); `rendered`: the conversation already rendered; `tools`: the
        functions the template offers (checked: lever.model.tool_calls.check_tools)."""
        if rendered is None:
            rendered = self.renderer.render(self.chat_template, messages, tools)
        # the template writes its own special tokens, a leading BOS among them
        return self.engine.tok.encode_chat(rendered) or _empty()

    def offer(self, tools: list[dict] | None = None, tool_choice=None, parallel_tool_calls: bool | None = None
              ) -> Offer:
        """The functions a call offers (OpenAI's `tools`, checked) and the grammar a required or
        named call brings (lever.model.tool_calls.plan; `parallel_tool_calls` false: exactly one), in
        the format the chat template teaches (`tool_format`)."""
        shown, grammar = plan(self.engine.tok, tools, tool_choice, parallel_tool_calls is not False,
                              fmt=tool_format(self))
        return Offer(tuple(shown) if shown else None, grammar)

    def prepare(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                rendered: Rendered | None = None, offer: Offer | None = None, tools: list[dict] | None = None,
                tool_choice=None, parallel_tool_calls: bool | None = None, ids: Sequence[int] | None = None,
                **args) -> Call:
        """A generation call, checked once (lever.api.call): a completion of `prompt`, or a
        reply to `messages` through the chat template (`rendered`: already rendered, as a server
        does before it queues the call), with the functions `tools` offers (or an `offer` made
        already) and the call's arguments: the knobs by their call names (lever.config.KNOBS),
        `stop`, `logprobs`, a `grammar` (Lark or GBNF text, a Grammar) or a `json_schema`, a
        `cancel` event; or `ids`, a prompt of token ids (a server's, or a FIM prompt: lever.gguf.fim).
        One line naming the argument at fault."""
        if offer is None:
            offer = self.offer(tools, tool_choice, parallel_tool_calls)
        if offer.grammar is not None:
            if args.get("grammar") is not None or args.get("json_schema") is not None:
                raise LeverError("tool_choice: a required call is its own grammar; drop grammar / json_schema "
                                 "(response_format)")
            args = {**args, "grammar": offer.grammar}
        if messages is not None:
            ids = self.encode_chat(messages, rendered, tools=list(offer.tools) if offer.tools else None)
        elif ids is not None and prompt is None:
            ids = prompt_ids(ids, self.tokenizer.vocab_size)
        elif isinstance(prompt, str):
            ids = self.engine.encode(prompt)
        else:
            raise LeverError(f"prompt: must be a string, got {type(prompt).__name__}")
        gen, stops, logprobs = prepare_generate(args, self.config.generate, n_prompt=len(ids), n_ctx=self.n_ctx,
                                                n_ctx_source=self.n_ctx_source, tok=self.tokenizer)
        if not self.structured and (args.get("grammar") is not None or args.get("json_schema") is not None):
            raise LeverError("grammar: structured output is off here (lever serve --no-grammars gave its memory to "
                             "the model); drop grammar / json_schema / response_format / a required tool call, or "
                             "restart the server without --no-grammars")
        grammar = self.grammars.get(args.get("grammar"), args.get("json_schema"))
        return Call(ids=ids, generate=gen, stop=stops, logprobs=logprobs, grammar=grammar, tools=offer.tools,
                    cancel=args.get("cancel") or threading.Event())

    def generate(self, prompt: str, **args) -> Completion:
        """A completion of `prompt`; `args`: the generation knobs by their call names
        (lever.config.KNOBS: max_tokens, temperature, top_k, ...), `stop` strings, `logprobs`
        (alternatives per token), a `grammar` (Lark or llama.cpp's GBNF text, or a
        lever.model.grammar.Grammar) or a `json_schema` (a dict) the text must follow, a `cancel` event."""
        return self.run(self.prepare(prompt, **args))

    def stream(self, prompt: str, **args) -> Iterator[Chunk]:
        """The completion as it is decoded: each chunk's text is final (stop strings held back
        until they cannot match, UTF-8 never split). Leaving the loop early cancels the
        generation at the end of its current pass."""
        return self.stream_call(self.prepare(prompt, **args))

    def chat(self, messages: Sequence[dict], **args) -> Completion:
        """The assistant's reply to `messages`, through the chat template. With `tools` (OpenAI's
        function definitions) the template offers them and the reply's calls come back parsed
        (`Completion.tool_calls`, lever.model.tool_calls); `tool_choice` "required" or a named
        function makes the reply a call, enforced by a grammar; "none" offers no tools."""
        return self.run(self.prepare(messages=messages, **args))

    def stream_chat(self, messages: Sequence[dict], **args) -> Iterator[Chunk]:
        """`chat`, streamed: with `tools`, text streams until a call may begin and the calls come
        whole on the last chunk (`Chunk.tool_calls`)."""
        return self.stream_call(self.prepare(messages=messages, **args))

    def session(self, cache: PrefixCache | None = None) -> Session:
        """A conversation whose text stays in both KV caches between calls (lever.api.conversation);
        `cache`: other conversations kept between calls (a server's, by client)."""
        return Session(self, cache=cache)

    def run(self, call: Call, *, session: Session | None = None, client: object = None, on_text=None,
            watch: Watch | None = None, turn=None) -> Completion:
        """One prepared call (`on_text(text, tokens, logprobs)`: each piece as it is final); in
        `session`, the prefix its caches already hold is not prefilled again, when the
        session's last call was `client`'s (a server's clients never share a prefix); `watch`:
        who sees its cycles (a live page's; default this LLM's `watch`); `turn`: a context the
        call waits in before it takes the model (a server's turns among its clients); a session
        it yields is the one the call runs in (a server's slot). With [pipeline] parallel N, up
        to N calls run at once, each from its own thread, sharing the target's passes; each
        gives the tokens it gives alone."""
        text = TextStream(self.engine.tok, call.stop, on_text, frozenset(self.engine.tok.eos_ids), call.cancel,
                          grammar=call.grammar, offered=Offer(call.tools).names if call.tools else None,
                          tool_format=tool_format(self) if call.tools else GENERIC)
        with turn if turn is not None else contextlib.nullcontext() as slot:
            session = slot if isinstance(slot, Session) else session
            with self.lanes.hold(session) as batcher:
                if call.cancel.is_set():  # its caller left while it waited
                    raise Cancelled("the generation was cancelled before it started")
                watch = watch or self.watch
                watch = watch.run(client) if watch is not None else None
                if session is None:
                    res, cached = self.engine.run(call.request(text, watch=watch, batcher=batcher)), 0
                else:
                    session.switch(list(call.ids), client)
                    res, cached = session.run(call, text, watch=watch, batcher=batcher)
        text.finish()
        reason = StopReason.STOP if text.stopped_at >= 0 else res.stop_reason or StopReason.LENGTH
        tokens = tuple(text.tokens)
        reply, calls = text.reply()
        return Completion(reply, tokens, reason, Usage(len(call.ids), len(tokens), cached), res,
                          tuple(text.logprobs) if call.logprobs is not None else None, tuple(calls))

    def stream_call(self, call: Call, *, session: Session | None = None, client: object = None,
                    watch: Watch | None = None, turn=None) -> Iterator[Chunk]:
        """One prepared call, streamed (as `stream`): the generation runs in a thread of its own;
        leaving the loop early cancels it at the end of its current pass. Text from where a tool
        call may begin is held (lever.pipelines.text); the calls come whole on the last chunk."""
        out: queue.Queue = queue.Queue()
        done = object()

        def piece(text: str, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]) -> None:
            out.put(Chunk(text, len(tokens), logprobs=logprobs, tokens=tokens))

        def work():
            try:
                out.put(self.run(call, session=session, client=client, on_text=piece, watch=watch, turn=turn))
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
                        yield Chunk("", 0, item.finish_reason, usage=item.usage, stats=item.stats,
                                    tool_calls=item.tool_calls)
                    elif item.text or item.n_tokens:
                        yield item
            finally:
                call.cancel.set()  # a consumer that left early ends the generation at its next pass
                worker.join()

        return chunks()

    def close(self) -> None:
        self.grammars.close()  # a compile under way (a server's request thread) fails at once
        self.renderer.close()  # so does a render
        with self.lanes.all():  # no generation is running
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _empty():
    raise LeverError("empty prompt")


def tool_format(llm: LLM) -> ToolFormat:
    """The format the model's chat template teaches it to write calls in (lever.model.tools.formats,
    detected once per template text); llama.cpp's generic one for a model without a template."""
    try:
        return detect(llm.chat_template.text)
    except LeverError:
        return GENERIC


def prompt_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """A prompt given as ids, each checked against the vocabulary (one line naming the first
    that is not in it)."""
    ids = [int(i) for i in ids]
    if not ids:
        raise LeverError("prompt: empty")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise LeverError(f"prompt: token id {bad} is not in the vocabulary [0, {vocab_size})")
    return ids
