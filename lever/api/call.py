"""A generation call, checked once: what `LLM.prepare` makes and `LLM.run` runs, and what comes back.

The bottom of lever.api. A call's arguments (the [generate] knobs by their call names, stop
strings, logprobs, a grammar or a JSON schema, the functions offered, a cancel event) are checked
against their bounds and the context in one place, `prepare_generate` here with `LLM.prepare`,
and travel as one frozen `Call` from there: to the engine's Request (`Call.request`), a
conversation's run, the server's worker threads. What a call gives back is a `Completion`, or
`Chunk`s when it is streamed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

import attrs

from lever.config import KNOBS, GenerateConfig
from lever.dataflow.messages import TokenLogprob
from lever.errors import LeverError
from lever.gguf.chat_template import Rendered
from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar import Grammar, Source
from lever.model.sampling import LogitBias
from lever.model.stop import StopReason
from lever.model.tool_calls import ToolCall
from lever.pipelines.batcher import Batcher
from lever.pipelines.compose import KVState, Request
from lever.pipelines.result import RunResult
from lever.pipelines.text import TextStream
from lever.pipelines.watch import RunWatch

MAX_STOP_STRINGS = 16  # as OpenAI's API bounds them (it allows 4); each is matched on every pass
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs bounds them
MAX_BIAS_TEXT_CHARS = 1024  # a logit_bias entry's text: a word or a phrase, tokenized with the call
INTEGER = re.compile(r"\s*[+-]?[0-9]+")
# a call's keywords beside the functions offered (tools, tool_choice, parallel_tool_calls)
CALL_ARGS = (*(k.arg for k in KNOBS.values()), "logit_bias", "ignore_eos", "stop", "logprobs", "grammar",
             "json_schema", "cancel")


class Cancelled(LeverError):
    """A generation whose cancel event was set before it could start."""


@attrs.frozen
class Offer:
    """The functions a call offers (OpenAI's `tools`, checked; None: none) and the grammar a
    required or named call brings (lever.model.tool_calls.plan; None under "auto")."""

    tools: tuple[dict, ...] | None = None
    grammar: Source | None = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools or ())


@attrs.frozen(kw_only=True)
class Call:
    """One generation, checked: the prompt's ids, the knobs as this call's [generate], its stop
    strings, logprobs (alternatives per token; None: not computed), its compiled grammar, the
    functions it offers (their calls are parsed out of the reply), its cancel event."""

    ids: tuple[int, ...] = attrs.field(converter=tuple)
    generate: GenerateConfig
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    grammar: Grammar | None = None
    tools: tuple[dict, ...] | None = None
    cancel: threading.Event = attrs.field(factory=threading.Event, eq=False)

    def request(self, text: TextStream, *, watch: RunWatch | None = None, kv: KVState | None = None,
                cached: int = 0, batcher: Batcher | None = None) -> Request:
        """The engine's request, its text leaving by `text`: the ids past the `cached` ones `kv`
        already holds (a conversation's), the rest as the text before them (the repeat penalty);
        `batcher`: the passes it shares with the other generations running (parallel lanes)."""
        return Request(self.ids[cached:], self.generate, text, kv=kv, history=self.ids[:cached],
                       logprobs=self.logprobs, grammar=self.grammar, watch=watch, batcher=batcher)


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
    tokens: tuple[int, ...] = ()  # the ids of this chunk's tokens (n_tokens of them)


def prepare_generate(args: dict, defaults: GenerateConfig, *, n_prompt: int, n_ctx: int, n_ctx_source: str,
                     tok: Tokenizer | None = None) -> tuple[GenerateConfig, tuple[str, ...], int | None]:
    """A call's knobs as this call's [generate] (each within its call bound: [generate]'s, and
    max_tokens at least 1), its logit bias over `tok`'s vocabulary (`logit_bias`, `ignore_eos`),
    its stop strings and logprobs; the prompt and max_tokens within the context. One line naming
    the argument at fault."""
    unknown = [k for k in args if k not in CALL_ARGS]
    if unknown:
        raise LeverError(f"unknown argument {unknown[0]!r} (known: {', '.join(CALL_ARGS)}, tools, tool_choice, "
                         f"parallel_tool_calls)")
    changes = {}
    for k in KNOBS.values():
        v = args.get(k.arg)
        if v is None:
            continue
        problem = k.call.problem(v)
        if problem is not None:
            raise LeverError(f"{k.arg}: {problem}")
        changes[k.key] = int(v) if k.call.integer else float(v)
    if args.get("logit_bias") is not None:
        changes["logit_bias"] = logit_bias(args["logit_bias"], tok)
    if args.get("ignore_eos") is not None:
        if not isinstance(args["ignore_eos"], bool):
            raise LeverError(f"ignore_eos: must be true or false, got {args['ignore_eos']!r:.40}")
        changes["ignore_eos"] = args["ignore_eos"]
    gen = attrs.evolve(defaults, **changes)
    if tok is not None:  # the ids in the vocabulary, a token left to choose
        gen.params(frozenset(tok.eos_ids)).logit_bias.check(tok.vocab_size)
    logprobs = args.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise LeverError(f"logprobs: must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), "
                         f"got {logprobs!r}")
    if n_prompt >= n_ctx:  # the prompt alone: no max_tokens would help
        raise LeverError(f"prompt: {n_prompt} tokens exceeds the available context size of {n_ctx} ({n_ctx_source})")
    # max_tokens past the context's room is llama-server's "until the context is full": the
    # generation stops there (StopReason.CONTEXT), honestly, as its own does without a shift
    return gen, stop_strings(args.get("stop")), logprobs


def logit_bias(value, tok: Tokenizer | None) -> LogitBias:
    """A call's logit_bias as llama-server reads it: [[token, bias], ...] or OpenAI's {token: bias},
    a token given by its id or by a text standing for each of the text's tokens (tokenized as
    llama-server does: no BOS, special-token text as text; an object's key of digits is an id);
    a bias a number, or false or -inf: never (lever.model.sampling.LogitBias)."""
    if isinstance(value, LogitBias):
        return value
    if isinstance(value, dict):  # a key that is a number, as llama-server's strtol reads it, is an id
        entries = [(int(k) if isinstance(k, str) and INTEGER.fullmatch(k) else k, b) for k, b in value.items()]
    elif isinstance(value, (list, tuple)):
        entries = list(value)
    else:
        return LogitBias(value)  # its one line: what the field may be
    pairs = []
    for e in entries:
        if isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], str):
            pairs += [(i, e[1]) for i in _text_ids(e[0], tok)]
        else:
            pairs.append(e)
    return LogitBias(pairs)


def _text_ids(text: str, tok: Tokenizer | None) -> list[int]:
    if len(text) > MAX_BIAS_TEXT_CHARS:
        raise LeverError(f"logit_bias: a text is {MAX_BIAS_TEXT_CHARS} characters at most, got {len(text)}")
    if tok is None:
        raise LeverError(f"logit_bias: {text!r:.40} is a text, and no tokenizer reads it here: give token ids")
    return tok.encode_chat(Rendered(text, tuple(range(len(text)))))  # each special-token text: the user's text


def stop_strings(stop) -> tuple[str, ...]:
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
