"""llama-server's own routes: `/completion` and `/completions` (its native request and answer),
`/infill` (fill in the middle: llama.vscode and Continue call it), `/apply-template`, `/props`,
`/slots`, and `/chat/completions/input_tokens`.

A dialect of lever.serve.dialect, beside OpenAI's: its request's names (n_predict, n_probs,
prompt as text, token ids or several prompts, return_tokens, input_prefix / input_suffix /
input_extra) translated into the completions fields preparation checks (lever.serve.request,
lever.serve.prepare builds a FIM prompt through lever.gguf.fim), its answer in llama-server's
shape (content, tokens, stop, stop_type, timings, generation_settings, the prompt as its tokens
read, completion_probabilities...), a stream of `data:` events each with `stop`; several prompts
or choices answer a list. The same body is the `__verbose` field OpenAI's answers carry when
asked (lever.serve.render). Where llama-server and OpenAI differ, these routes follow llama-server.
"""

from __future__ import annotations

import codecs
from pathlib import Path

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lever.api import Chunk, Completion
from lever.config import N_PREDICT
from lever.dataflow.messages import TokenLogprob
from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model.stop import StopReason
from lever.serve.dialect import OPENAI_CHAT, Dialect, openai_error, public, refusal
from lever.serve.pool import client_of
from lever.serve.render import sse, timings
from lever.serve.request import SHUTTING_DOWN, BadRequest, shutting_down
from lever.serve.request import generation_settings as knobs
from lever.serve.webui import BUILD

# llama-server's stop_type of each of Lever's reasons (a cut generation is never reported as finished)
STOP_TYPE = {StopReason.STOP: "word", StopReason.EOS: "eos", StopReason.LENGTH: "limit",
             StopReason.CONTEXT: "limit", StopReason.CANCELLED: "none"}
RENAMED = {"n_predict": "max_tokens", "temp": "temperature"}  # llama-server's names of OpenAI's fields
# llama-server's samplers Lever has not, at the values that leave them off (generation_settings lists them)
OFF = {"dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
       "xtc_threshold": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0, "mirostat": 0, "adaptive_target": -1.0,
       "adaptive_decay": 0.9}


def translate(data: dict) -> dict:
    """llama-server's request as the completions fields: its names for OpenAI's, n_probs as the
    alternatives per token (logprobs); n_predict -1 (until the context ends) as no limit."""
    out = dict(data)
    for theirs, ours in RENAMED.items():
        if theirs in out:
            out.setdefault(ours, out.pop(theirs))
    if out.get("max_tokens") == -1:  # llama-server's "until the context or an end": the context stops it
        out["max_tokens"] = int(N_PREDICT.hi)
    n_probs = out.pop("n_probs", None)
    if n_probs not in (None, 0, False):
        out.setdefault("logprobs", n_probs)
    return out


def translate_infill(data: dict) -> dict:
    """/infill: the code around the cursor (input_prefix, input_suffix, input_extra) and what is
    typed at it (prompt)."""
    out = translate(data)
    out.setdefault("prompt", "")
    out.setdefault("input_prefix", "")
    out.setdefault("input_suffix", "")
    extra = out.get("input_extra")
    if extra is not None and not (isinstance(extra, list) and all(
            isinstance(x, dict) and isinstance(x.get("text", ""), str) and isinstance(x.get("filename", ""), str)
            for x in extra)):
        raise BadRequest("input_extra: a list of {\"filename\": string, \"text\": string}", "input_extra")
    return out


def generation_settings(call, shape, eos_ids=frozenset()) -> dict:
    """llama-server's generation_settings of a call: its knobs by llama-server's names
    (lever.serve.request.generation_settings), the samplers Lever has not at their off values
    (OFF), its stop strings, what the answer was asked to carry."""
    options = getattr(shape, "options", {})
    return {**knobs(call.generate, eos_ids), **OFF, "stop": list(call.stop), "n_keep": 0, "stream": shape.stream,
            "n_probs": call.logprobs or 0, "min_keep": 0,
            "post_sampling_probs": bool(options.get("post_sampling_probs")),
            "timings_per_token": bool(options.get("timings_per_token")), "speculative.types": "lever-trees"}


def prompt_text(tok: Tokenizer, ids) -> str:
    """The prompt as llama-server shows it: its tokens' pieces, control tokens by their names."""
    return b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", "replace")


def probabilities(tok: Tokenizer, logprobs, post_sampling: bool = False) -> list[dict]:
    """llama-server's completion_probabilities: each token's id, text, bytes and logprob (or
    prob, `post_sampling`), with its likeliest alternatives; the end-of-turn token listed too."""
    key, top = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def entry(token: int, logprob: float) -> dict:
        b = tok.token_bytes(token)
        value = 2.718281828459045 ** logprob if post_sampling else max(logprob, -3.4028234663852886e38)
        return {"id": token, "token": b.decode("utf-8", "ignore"), "bytes": list(b), key: value}

    return [entry(lp.token, lp.logprob) | {top: [entry(t, v) for t, v in lp.top]} for lp in logprobs]


@attrs.frozen
class NativeReply:
    """A generation in llama-server's /completion shape."""

    rid: str
    chat: bool
    model_id: str
    tok: Tokenizer
    return_tokens: bool = False
    settings: dict = attrs.field(factory=dict)  # the call's generation_settings
    prompt: str = ""  # the prompt as its tokens read
    probs: bool = False  # completion_probabilities (n_probs)
    post_sampling: bool = False
    fields: tuple[str, ...] = ()  # response_fields: the answer's fields kept, by their paths
    index: int = 0  # which of the request's answers (several prompts or choices)
    media_type = "text/event-stream"

    def bind(self, *, call, shape) -> NativeReply:
        options = getattr(shape, "options", {})
        return attrs.evolve(self, return_tokens=shape.return_tokens,
                            settings=generation_settings(call, shape, self.tok.eos_ids),
                            prompt=prompt_text(self.tok, call.ids), probs=call.logprobs is not None,
                            post_sampling=bool(options.get("post_sampling_probs")),
                            fields=tuple(options.get("response_fields") or ()))

    def body(self, c: Completion) -> dict:
        out = {"index": self.index, "content": c.text, "tokens": list(c.tokens) if self.return_tokens else [],
               "id_slot": 0, "stop": True, "model": self.model_id, "tokens_predicted": len(c.tokens),
               "tokens_evaluated": c.usage.prompt_tokens, "generation_settings": self.settings,
               "prompt": self.prompt, "has_new_line": "\n" in c.text,
               "truncated": c.finish_reason == StopReason.CONTEXT,  # llama-server's: the context filled
               "stop_type": STOP_TYPE[c.finish_reason], "stopping_word": "", "tokens_cached": c.usage.cached_tokens,
               "timings": timings(c.stats, c.usage.cached_tokens)}
        if self.probs and c.logprobs:
            out["completion_probabilities"] = probabilities(self.tok, c.logprobs, self.post_sampling)
        return picked(out, self.fields) if self.fields else out

    def bodies(self, cs: list[Completion]) -> dict | list:
        """The request's answers: one body, or a list of them (several prompts or choices)."""
        out = [attrs.evolve(self, index=i).body(c) for i, c in enumerate(cs)]
        return out[0] if len(out) == 1 else out

    def opening(self) -> list[str]:
        return []

    def piece(self, chunk: Chunk, n_chars: int, logprobs: bool) -> list[str]:
        if not (self.probs and chunk.logprobs):
            return [sse(self._event(chunk.text, chunk.tokens))]
        # n_probs: an event per token, each with its probabilities, as llama-server streams them
        return [sse(self._event(text, (lp.token,)) | {"completion_probabilities": probabilities(
                    self.tok, [lp], self.post_sampling)}) for text, lp in zip(
                    token_texts(self.tok, chunk), chunk.logprobs, strict=False)]

    def progress(self, fields: dict) -> list[str]:
        """llama-server's prompt_progress report (lever.serve.progress), on an event of no text."""
        return [sse(self._event("", ()) | fields)]

    def _event(self, text: str, tokens) -> dict:
        return {"index": self.index, "content": text, "tokens": list(tokens), "stop": False, "id_slot": 0}

    def closing(self, chunk: Chunk) -> list[str]:
        u = chunk.usage
        return [sse({"index": self.index, "content": "", "tokens": [], "stop": True, "id_slot": 0,
                     "model": self.model_id, "tokens_predicted": u.completion_tokens if u else 0,
                     "tokens_evaluated": u.prompt_tokens if u else 0, "generation_settings": self.settings,
                     "prompt": self.prompt, "has_new_line": False,
                     "truncated": chunk.finish_reason == StopReason.CONTEXT,
                     "stop_type": STOP_TYPE[chunk.finish_reason], "stopping_word": "",
                     "tokens_cached": u.cached_tokens if u else 0,
                     **({"timings": timings(chunk.stats, u.cached_tokens)} if chunk.stats else {})})]

    @staticmethod
    def trailer(usage_asked: bool, n_prompt: int, n_out: int) -> list[str]:
        return []  # llama-server's native stream ends with its stop event, no [DONE]

    @staticmethod
    def failed(message: str, kind: str, param: str | None = None) -> str:
        return sse(openai_error(message, kind, param))


def token_texts(tok: Tokenizer, chunk: Chunk) -> list[str]:
    """A chunk's text split at its tokens (those of its logprobs): each token's piece (UTF-8
    joined across tokens), cut to the chunk's text, the last taking what remains, so that the
    pieces join into the text (a stop string cut from it included)."""
    decoder, out, at = codecs.getincrementaldecoder("utf-8")("replace"), [], 0
    lps: list[TokenLogprob] = list(chunk.logprobs)
    for lp in lps:
        n = len(decoder.decode(tok.token_bytes(lp.token)))
        out.append(chunk.text[at:at + n])
        at += n
    if out:
        out[-1] += chunk.text[at:]
    return out


def picked(body: dict, paths: tuple[str, ...]) -> dict:
    """llama-server's response_fields: the answer with only these fields, each by its path
    ("generation_settings/n_predict") as its key; a path not in it is left out."""
    out = {}
    for path in paths:
        value, found = body, True
        for part in str(path).split("/"):
            if not isinstance(value, dict) or part not in value:
                found = False
                break
            value = value[part]
        if found:
            out[path] = value
    return out


COMPLETION = Dialect("completion", "completions", NativeReply, "cmpl-", translate)
INFILL = Dialect("infill", "completions", NativeReply, "cmpl-", translate_infill)
# llama-server answers /completions in its own shape, /v1/completions in OpenAI's
GENERATIONS = {"/completion": COMPLETION, "/completions": COMPLETION, "/infill": INFILL}


async def apply_template(server, request: Request) -> Response:
    """/apply-template: the conversation as the chat template writes it, to the assistant's turn
    (as the request's add_generation_prompt and chat_template_kwargs say)."""
    with server.pool.hold(client_of(request)) as hold:  # read, parsed and rendered as a chat's, bounded alike
        try:
            rendered = await server.prep.rendered(request, hold)
        except BadRequest as e:
            return JSONResponse(openai_error(e.message, e.kind, e.param), status_code=e.status)
        except LeverError as e:
            return JSONResponse(openai_error(public(str(e)), "invalid_request_error"), status_code=400)
    return JSONResponse({"prompt": server.llm.renderer.shown(rendered)})  # the BOS its tokenizing adds left out


def check_asks(call, shape, n_slots: int) -> None:
    """What a request asks of its answer that Lever gives only in part, refused by name: more
    choices (n) than slots (llama-server's bound), post-sampling probabilities where sampling
    does not draw from the model's own distribution (the logprobs are the raw logits', so
    only temperature 1 with no cut, penalty or bias makes them the sampled distribution's)."""
    if shape.n > n_slots:
        raise BadRequest(f"n: at most {n_slots} choices (the server's slots: --parallel), got {shape.n}", "n")
    g = call.generate
    plain = (g.temperature == 1.0 and g.top_k == 0 and g.top_p == 1.0 and g.min_p == 0.0 and g.repeat_penalty == 1.0
             and not getattr(g, "presence_penalty", 0.0) and not getattr(g, "frequency_penalty", 0.0)
             and not getattr(g, "logit_bias", None) and not getattr(g, "ignore_eos", False) and call.grammar is None)
    if shape.options.get("post_sampling_probs") and call.logprobs is not None and not plain:
        raise BadRequest("post_sampling_probs: Lever's probabilities are the model's own; they are the sampled "
                         "ones only at temperature 1 without top_k, top_p, min_p, penalties, bias or grammar",
                         "post_sampling_probs")


async def props(server, request: Request) -> Response:
    """llama-server's /props, its fields Lever has: the chat template (empty without one: a
    client then sends completions), the slots and each one's context, the defaults; the model's
    file by its name only (where it sits on the server's disk is no client's business)."""
    llm = server.llm
    try:
        template = llm.chat_template.text
    except LeverError:
        template = ""
    tok = llm.tokenizer
    return JSONResponse({
        "model_alias": server.model_id, "model_path": Path(llm.config.model.target).name, "chat_template": template,
        "total_slots": server.slots.n, "modalities": {"vision": False, "video": False, "audio": False},
        "default_generation_settings": {"n_ctx": llm.n_ctx, "params": knobs(llm.config.generate, tok.eos_ids)},
        "endpoint_slots": server.settings.slots, "endpoint_metrics": server.metrics is not None,
        "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
        "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else "", "build_info": BUILD})


async def slots(server, request: Request) -> Response:
    """llama-server's /slots (unless --no-slots): each slot's context, which one processes and
    its task (lever.serve.admission.Slots); ?fail_on_no_slot: 503 when none is idle."""
    if not server.settings.slots:
        return JSONResponse(openai_error("this server does not serve /slots: start it with --slots",
                                         "not_supported_error"), status_code=501)
    view = server.slots.view()
    if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in view):
        return JSONResponse(openai_error("no slot available", "unavailable_error"), status_code=503)
    return JSONResponse(view)


def _openai_count(n: int) -> dict:
    return {"input_tokens": n, "object": "response.input_tokens"}


async def input_tokens(server, request: Request, dialect: Dialect = OPENAI_CHAT, body=_openai_count) -> Response:
    """/chat/completions/input_tokens (and the Responses API's, and Anthropic's count_tokens in
    its dialect and `body`): how many tokens the prompt is (read, rendered and tokenized as the
    generation's, within the same bounds; never queued)."""
    with server.pool.hold(client_of(request)) as hold:
        try:
            if server.closing:
                raise shutting_down()
            _, call = await server.prep.call(request, dialect, hold)
        except BadRequest as e:
            return server.refused(dialect, e.message, e.status, e.kind, e.param)
        except LeverError as e:
            return dialect.error(*SHUTTING_DOWN) if server.closing else server.refused(dialect, **refusal(str(e)))
    return JSONResponse(body(len(call.ids)))


def routes(server) -> list:
    """llama-server's routes that are not generations."""
    def bound(endpoint):  # a route's function of (server, request) as starlette's endpoint of the request
        async def route(request: Request) -> Response:
            return await endpoint(server, request)
        route.__name__ = endpoint.__name__
        return route

    return [Route("/props", bound(props)), Route("/slots", bound(slots)),
            Route("/apply-template", bound(apply_template), methods=["POST"]),
            *[Route(path, bound(input_tokens), methods=["POST"])
              for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens")]]
