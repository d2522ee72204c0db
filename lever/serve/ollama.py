"""Ollama's API over the one model: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`,
`/api/ps`, `/api/version`, so apps written for Ollama (its own clients among them) talk to
`lever serve` unchanged.

A dialect of lever.serve.dialect, wired by lever.serve.server: each body is translated into
OpenAI's fields (lever.serve.request checks, bounds and refuses them by name; the refusals are
then named again by Ollama's fields, `options.num_predict` for max_tokens, `format` for the
schema), the answer is Ollama's NDJSON (`done` last, with its counts and durations in ns). The
generation routes need the server's model (its context, its chat template), so `routes(server)`
makes them; GENERATIONS stays empty. A `suffix` makes the model's fill-in-the-middle prompt
(lever.gguf.fim) as llama-server's /infill does (lever.serve.llama). What Ollama does and Lever
does not is refused by name, never ignored where it would change the answer: images, a
request's own `template`, a `context` to continue, sampling Lever has not (mirostat,
penalties), a `num_ctx` past the server's context. What only tells Ollama how to load a model
(num_gpu, num_thread, keep_alive...) is let go: here the model is loaded once, by `lever serve`.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import re
import threading
import time
from pathlib import Path

import anyio
import attrs
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lever.api import Chunk, Completion, Usage
from lever.api.render import PromptTooLong
from lever.errors import LeverError
from lever.gguf.chat_template import DEFUSE
from lever.gguf.file import GGUFFile
from lever.gguf.fim import FimTokens
from lever.gguf.identity import ModelIdentity
from lever.gguf.tokenizer import Tokenizer
from lever.model.stop import StopReason
from lever.serve.dialect import Dialect, public
from lever.serve.render import chat_logprobs
from lever.serve.request import BadRequest

GENERATIONS: dict = {}  # route -> Dialect: none without the server's model (routes() makes them)
# Ollama's clients ask /api/version before using newer fields; this is the release whose API
# Lever's covers (tools, format as a JSON schema, logprobs); Lever's own version is beside it
VERSION = "0.12.0"
DONE = {StopReason.STOP: "stop", StopReason.EOS: "stop", StopReason.LENGTH: "length",
        StopReason.CONTEXT: "length", StopReason.CANCELLED: "stop"}
# options Lever honours: Ollama's name -> the call's (lever.config.KNOBS)
OPTIONS = {"num_predict": "max_tokens", **{k: k for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                                          "repeat_last_n", "seed", "stop")}}
# sampling Lever has not: accepted only at the value that turns it off
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "mirostat": 0, "typical_p": 1, "tfs_z": 1}
# how Ollama loads and runs a model, not what it answers: here `lever serve` loaded it once
# (num_keep: Lever never shifts a context, it refuses a prompt past it; penalize_newline: Ollama ignores it too)
LOADING = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "vocab_only", "use_mmap", "use_mlock",
                     "num_thread", "embedding_only", "logits_all", "f16_kv", "num_gqa", "num_keep", "penalize_newline"})
# the fields a refusal names (OpenAI's, lever.serve.request) as an Ollama client sent them
RENAMED = {**{v: f"options.{k}" for k, v in OPTIONS.items()}, "json_schema": "format", "response_format": "format",
           "input_prefix": "prompt", "input_suffix": "suffix"}
FOREVER = "2999-01-01T00:00:00Z"  # /api/ps's expires_at: the model is never unloaded
# what Ollama does that one loaded model does not: refused in Ollama's form, saying why
NOT_HERE = {"/api/pull": "POST", "/api/push": "POST", "/api/create": "POST", "/api/copy": "POST",
            "/api/delete": "DELETE", "/api/embed": "POST", "/api/embeddings": "POST"}


def renamed(message: str) -> str:
    """A refusal's line with the field it names first as the Ollama client sent it."""
    m = re.match(r"[a-z_]+", message)
    if m is None or m.group() not in RENAMED or message[m.end():m.end() + 1] not in (":", ".", "["):
        return message
    return RENAMED[m.group()] + message[m.end():]


def error_body(message: str, kind: str = "", param: str | None = None) -> dict:
    """Ollama's refusal: {"error": "..."} with the HTTP status."""
    return {"error": renamed(message)}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def ndjson(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


# -- requests: Ollama's bodies as OpenAI's fields


def _str_field(data: dict, name: str) -> str | None:
    v = data.get(name)
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"{name}: must be a string, got {json.dumps(v)[:40]}", name)
    return v


def options(opts, n_ctx: int) -> dict:
    """Ollama's `options` as the call's knobs; one it has and Lever not is refused by name."""
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise BadRequest("options: must be an object", "options")
    out = {}
    for k, v in opts.items():
        if v is None or k in LOADING:
            continue
        if k == "num_predict" and isinstance(v, int) and v in (-1, -2):
            continue  # Ollama's "until it stops" and "fill the context": the server's bound
        if k in OPTIONS:
            out[OPTIONS[k]] = v
        elif k == "num_ctx":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadRequest(f"options.num_ctx: must be a positive integer, got {json.dumps(v)[:40]}",
                                 "options.num_ctx")
            if v > n_ctx:  # a smaller one is within the server's: a prompt past it is refused, never cut
                raise BadRequest(f"options.num_ctx: {v} is over this server's context of {n_ctx} tokens "
                                 "(lever serve --ctx-size)", "options.num_ctx")
        elif k in NEUTRAL:
            if v != NEUTRAL[k] or isinstance(v, bool):
                raise BadRequest(f"options.{k}: not supported by this server (only {NEUTRAL[k]}, off)",
                                 f"options.{k}")
        else:
            raise BadRequest(f"options.{k}: not an option this server knows", f"options.{k}")
    return out


def common(data: dict, n_ctx: int, chat: bool) -> dict:
    """The fields both generations share: model, stream (true unless false, as Ollama's),
    options, format, logprobs."""
    stream = True if data.get("stream") is None else data["stream"]
    out = {"model": data.get("model"), "stream": stream, **options(data.get("options"), n_ctx)}
    fmt = data.get("format")
    if fmt == "json":
        out["json_schema"] = {"type": "object"}
    elif isinstance(fmt, dict):
        out["json_schema"] = fmt
    elif fmt not in (None, ""):
        raise BadRequest(f'format: must be "json" or a JSON schema object, got {json.dumps(fmt)[:40]}', "format")
    top = data.get("top_logprobs")
    if top is not None and not data.get("logprobs"):
        raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
    if data.get("logprobs"):
        if chat:
            out.update(logprobs=data["logprobs"], top_logprobs=top)
        else:  # OpenAI's completions take the count of alternatives, true for none
            out["logprobs"] = top if top else data["logprobs"]
    if data.get("images"):
        raise BadRequest("images: this model reads no images", "images")
    return out


def message(i: int, m) -> dict:
    """One of Ollama's messages as OpenAI's: its calls' arguments are objects already (as the
    templates read them); a tool's reply names its function (`tool_name`), no call id."""
    if not isinstance(m, dict):
        return m  # refused by name where messages are checked (lever.gguf.chat_template)
    if m.get("images"):
        raise BadRequest(f"messages[{i}].images: this model reads no images", f"messages[{i}].images")
    out = {"role": m.get("role"), "content": m.get("content")}
    for key in ("tool_calls", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def chat_fields(data: dict, n_ctx: int) -> dict:
    """/api/chat's body as OpenAI chat's fields (`think` let go: no model here thinks apart)."""
    out = common(data, n_ctx, chat=True)
    msgs = data.get("messages")
    out["messages"] = [message(i, m) for i, m in enumerate(msgs)] if isinstance(msgs, list) else msgs
    if data.get("tools") is not None and data["tools"] != []:  # Ollama's client sends [] for none
        out["tools"] = data["tools"]
    return out


def generate_fields(data: dict, llm) -> dict:
    """/api/generate's body as OpenAI completions' fields: with `suffix`, the model's
    fill-in-the-middle prompt; `raw` (or a model with no chat template), the prompt as it is;
    else the prompt (and `system`) through the chat template, as Ollama does."""
    out = common(data, llm.n_ctx, chat=False)
    prompt, suffix, system = (_str_field(data, k) for k in ("prompt", "suffix", "system"))
    if _str_field(data, "template"):
        raise BadRequest("template: a request's own template is not supported: the model's chat template "
                         "applies; send raw: true with the prompt already templated", "template")
    if data.get("context"):
        raise BadRequest("context: not supported (no context is returned): send the whole conversation to "
                         "/api/chat", "context")
    if not prompt and not suffix:  # Ollama's "load the model": here it is loaded for good
        raise BadRequest("prompt: required (the model is always loaded: there is nothing to load)", "prompt")
    if suffix:  # the model's fill-in-the-middle prompt, as llama-server's /infill builds it (lever.serve.prepare)
        if system:
            raise BadRequest("system: a fill-in-the-middle prompt (suffix) has no place for it", "system")
        out.update(prompt="", input_prefix=prompt or "", input_suffix=suffix)
    elif data.get("raw") or template_of(llm) is None:
        if system:
            raise BadRequest("system: a raw prompt (or a model with no chat template) has no place for it", "system")
        out["prompt"] = prompt
    else:
        out["prompt"] = templated(llm, prompt, system)
    return out


def template_of(llm):
    try:
        return llm.chat_template
    except LeverError:
        return None


def templated(llm, prompt: str, system: str | None) -> str:
    """The prompt as the user's turn through the chat template (in the renderer's child,
    bounded): special-token text that came from the prompt is defused, so the text tokenizes
    to no control token it did not mean (a chat's messages tokenize it as text)."""
    msgs = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": prompt}]
    try:
        rendered = llm.renderer.render(template_of(llm), msgs)
    except PromptTooLong as e:
        raise BadRequest("prompt" + str(e)[len(e.field):], "prompt") from None
    text = list(rendered.text)
    for at in rendered.foreign:
        text[at] = DEFUSE
    text = "".join(text)
    tok = llm.tokenizer
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
    if tok.add_bos and bos and text.startswith(bos):  # the prompt's tokenizing adds it again
        text = text[len(bos):]
    return text


# -- answers


def tool_calls(calls) -> list[dict]:
    """A reply's calls in Ollama's shape: the arguments an object, not JSON text."""
    return [{"id": tc.id, "function": {"index": i, "name": tc.name, "arguments": arguments(tc.arguments)}}
            for i, tc in enumerate(calls)]


def arguments(text: str) -> dict:
    """A call's arguments as an object; a model that wrote them as other JSON, or as text that
    is none, has them kept whole under "arguments" (Ollama's clients take only an object)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


@attrs.frozen
class OllamaReply:
    """One request's answer in Ollama's shapes (lever.serve.render.Reply's methods): NDJSON
    lines, each {model, created_at, message | response, done}, the last with why it ended and
    the counts; durations in ns, the total from when the request was admitted."""

    rid: str
    chat: bool
    model_id: str
    tok: Tokenizer
    started_ns: int = attrs.field(factory=time.monotonic_ns)
    media_type = "application/x-ndjson"

    def line(self, text: str, done: bool, calls=()) -> dict:
        if self.chat:
            msg = {"role": "assistant", "content": text, **({"tool_calls": tool_calls(calls)} if calls else {})}
            return {"model": self.model_id, "created_at": now(), "message": msg, "done": done}
        return {"model": self.model_id, "created_at": now(), "response": text, "done": done}

    def figures(self, finish: StopReason | None, usage: Usage | None, stats) -> dict:
        t = stats.timing if stats is not None else None
        return {"done_reason": DONE.get(finish, "stop"), "total_duration": time.monotonic_ns() - self.started_ns,
                "load_duration": 0,  # loaded once, when the server started
                "prompt_eval_count": usage.prompt_tokens if usage else 0,
                "prompt_eval_duration": int(1e9 * t.prefill_s) if t else 0,
                "eval_count": usage.completion_tokens if usage else 0,
                "eval_duration": int(1e9 * t.decode_s) if t else 0}

    def opening(self) -> list[str]:
        return []

    def piece(self, chunk: Chunk, n_chars: int, logprobs: bool) -> list[str]:
        d = self.line(chunk.text, False)
        if logprobs:
            d["logprobs"] = chat_logprobs(self.tok, chunk.logprobs)["content"]
        return [ndjson(d)]

    def closing(self, chunk: Chunk) -> list[str]:
        """The calls a chat's reply made (a line of their own, as Ollama's), then the done line."""
        calls = [ndjson(self.line("", False, chunk.tool_calls))] if chunk.tool_calls else []
        return [*calls, ndjson({**self.line("", True), **self.figures(chunk.finish_reason, chunk.usage, chunk.stats)})]

    def trailer(self, usage_asked: bool, n_prompt: int, n_out: int) -> list[str]:
        return []  # the done line carries the counts

    @staticmethod
    def failed(message: str, kind: str = "", param: str | None = None) -> str:
        """A stream that fails mid-way ends with an error line (Ollama's clients raise it)."""
        return ndjson(error_body(message))

    def body(self, c: Completion) -> dict:
        d = {**self.line(c.text, True, c.tool_calls), **self.figures(c.finish_reason, c.usage, c.stats)}
        if c.logprobs is not None:
            d["logprobs"] = chat_logprobs(self.tok, c.logprobs)["content"]
        return d


# -- the model's listing and details


PARAMETERS = ("num_ctx", "num_predict", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
              "seed")
# llama.cpp's file types (general.file_type), the quantization Ollama shows
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              25: "IQ4_NL", 30: "IQ4_XS", 32: "BF16"}


@attrs.frozen
class Card:
    """What /api/tags, /api/show and /api/ps say of the model, read once from its GGUF."""

    name: str  # with Ollama's tag
    size: int  # the pair's files' bytes
    digest: str  # sha256 of the target's first MiB and size (lever.gguf.identity): not the file's, never read whole
    modified_at: str
    details: dict
    info: dict  # the target's scalar metadata (Ollama's model_info)

    def entry(self) -> dict:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details}


def human(n: int) -> str:
    """A parameter count as Ollama writes it: 1.5B, 494.03M."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.2f}K"


def read_card(model_id: str, config) -> Card:
    """The model's card from its files (the target's metadata and tensor table; the draft's size)."""
    f = GGUFFile(config.model.target)
    n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    kinds: dict[str, int] = {}
    for t in f.tensors.values():
        kinds[t.type.name] = kinds.get(t.type.name, 0) + t.n_bytes
    quant = FILE_TYPES.get(f.get("general.file_type"), max(kinds, key=kinds.get) if kinds else "")
    arch = f.get("general.architecture", "")
    info = {k: v for k, v in f.metadata.items() if isinstance(v, (int, float, str, bool))
            and not k.startswith("tokenizer.chat_template")}
    info.update({"general.parameter_count": n_params, "lever.draft": Path(config.model.draft).name
                 if config.model.draft else "", "lever.pipeline": config.pipeline.kind})
    target = Path(config.model.target)
    size = target.stat().st_size + (Path(config.model.draft).stat().st_size if config.model.draft else 0)
    ident = ModelIdentity.of(target)
    when = datetime.datetime.fromtimestamp(target.stat().st_mtime, datetime.UTC).isoformat().replace("+00:00", "Z")
    details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
               "parameter_size": human(n_params), "quantization_level": quant}
    name = model_id if ":" in model_id else model_id + ":latest"
    return Card(name=name, size=size, digest=ident.sha256_first_mib, modified_at=when, details=details, info=info)


@attrs.define
class Listing:
    """/api/tags, /api/show and /api/ps over the server's one model, answered in a worker
    thread (never on the event loop); its card is read from the files at the first ask, then
    kept (so not frozen: the server starts without reading them)."""

    server: object
    _card: Card | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def card(self) -> Card:
        with self._lock:
            if self._card is None:
                self._card = read_card(self.server.model_id, self.server.llm.config)
            return self._card

    async def tags(self, request: Request) -> Response:
        return await self._answer(lambda c: {"models": [c.entry()]})

    async def ps(self, request: Request) -> Response:
        return await self._answer(self.loaded)

    async def show(self, request: Request) -> Response:
        return await self._answer(self.shown)

    async def _answer(self, make) -> Response:
        try:
            return JSONResponse(await anyio.to_thread.run_sync(lambda: make(self.card())))
        except (LeverError, OSError) as e:
            return JSONResponse(error_body(f"the model's files: {public(str(e))}"), status_code=500)

    def loaded(self, c: Card) -> dict:
        llm = self.server.llm
        size = llm.memory_plan().rss_bound_bytes  # what it holds in memory at most: its RSS bound
        return {"models": [{**c.entry(), "size": size, "size_vram": 0, "expires_at": FOREVER,
                            "context_length": llm.n_ctx}]}

    def shown(self, c: Card) -> dict:
        llm = self.server.llm
        template = template_of(llm)
        gen = llm.config.generate
        values = {"num_ctx": llm.n_ctx, **{k: getattr(gen, "n_predict" if k == "num_predict" else k)
                                           for k in PARAMETERS[1:]}}
        params = "\n".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        text = template.text if template is not None else ""
        modelfile = (f"# lever serve: {c.name}\nFROM {llm.config.model.target}\n"
                     + (f'TEMPLATE """{text}"""\n' if text else "")
                     + "".join(f"PARAMETER {line}\n" for line in params.splitlines()))
        return {"modelfile": modelfile, "parameters": params, "template": text, "details": c.details,
                "model_info": c.info, "capabilities": capabilities(llm, text), "modified_at": c.modified_at}


def capabilities(llm, template: str) -> list[str]:
    """What the model does, as Ollama's clients read it: completion; tools when its template
    shows them; insert (fill-in-the-middle) when it has the tokens."""
    caps = ["completion"]
    if "tools" in template:
        caps.append("tools")
    try:
        FimTokens.of(llm.tokenizer)
        caps.append("insert")
    except LeverError:
        pass
    return caps


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION, "lever": lever_version()})


def not_here(path: str):
    async def route(request: Request) -> Response:
        return JSONResponse(error_body(f"{path}: not supported: lever serve serves the one model it was started "
                                       "with (lever pull fetches models, lever serve -m MODEL serves one)"),
                            status_code=501)
    return route


def routes(server) -> list:
    """Ollama's routes over the server (lever.serve.server.Server): its two generations, each a
    Dialect over the server's model, and the listing."""
    llm = server.llm
    chat = Dialect(name="ollama_chat", endpoint="chat", reply=OllamaReply, rid_prefix="ollama-",
                   translate=lambda data: chat_fields(data, llm.n_ctx), error_body=error_body)
    generate = Dialect(name="ollama_generate", endpoint="completions", reply=OllamaReply, rid_prefix="ollama-",
                       translate=functools.partial(generate_fields, llm=llm), error_body=error_body)
    listing = Listing(server)
    return [Route("/api/chat", server.generation(chat), methods=["POST"]),
            Route("/api/generate", server.generation(generate), methods=["POST"]),
            Route("/api/tags", listing.tags), Route("/api/ps", listing.ps),
            Route("/api/show", listing.show, methods=["POST"]), Route("/api/version", version),
            *[Route(path, not_here(path), methods=[method]) for path, method in NOT_HERE.items()]]


def lever_version() -> str:
    try:
        return importlib.metadata.version("lever")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
