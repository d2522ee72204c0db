"""llama-server's own routes: `/completion` (its native request and answer), `/infill` (fill in
the middle: llama.vscode and Continue call it), `/apply-template`, and `/slots`.

A dialect of lever.serve.dialect, beside OpenAI's: its request's names (n_predict, prompt as
text or token ids, return_tokens, input_prefix / input_suffix / input_extra) translated into
the completions fields preparation checks (lever.serve.request, lever.serve.prepare builds a
FIM prompt through lever.gguf.fim), its answer in llama-server's shape (content, tokens, stop,
stop_type, timings, generation_settings...), a stream of `data:` events each with `stop`.
Where llama-server and OpenAI differ, these routes follow llama-server.
"""

from __future__ import annotations

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lever.api import Chunk, Completion
from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model.stop import StopReason
from lever.serve.dialect import Dialect, openai_error, public
from lever.serve.pool import client_of
from lever.serve.render import sse, timings
from lever.serve.request import BadRequest

# llama-server's stop_type of each of Lever's reasons (a cut generation is never reported as finished)
STOP_TYPE = {StopReason.STOP: "word", StopReason.EOS: "eos", StopReason.LENGTH: "limit",
             StopReason.CONTEXT: "limit", StopReason.CANCELLED: "none"}
RENAMED = {"n_predict": "max_tokens", "temp": "temperature"}  # llama-server's names of OpenAI's fields


def translate(data: dict) -> dict:
    """llama-server's request as the completions fields: its names for OpenAI's, a prompt of
    token ids kept as ids; n_predict -1 (until the context ends) as no limit."""
    out = dict(data)
    for theirs, ours in RENAMED.items():
        if theirs in out:
            out.setdefault(ours, out.pop(theirs))
    if out.get("max_tokens") == -1:
        out.pop("max_tokens")  # llama-server's "until the context or an end": the context bounds it
    p = out.get("prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        out["prompt_ids"], out["prompt"] = p, ""
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


@attrs.frozen
class NativeReply:
    """A generation in llama-server's /completion shape."""

    rid: str
    chat: bool
    model_id: str
    tok: Tokenizer
    return_tokens: bool = False
    settings: dict = attrs.field(factory=dict)  # the call's generation_settings
    media_type = "text/event-stream"

    def bind(self, *, call, shape) -> NativeReply:
        g = call.generate
        settings = {"n_predict": g.n_predict, "seed": g.seed, "temperature": g.temperature, "top_k": g.top_k,
                    "top_p": g.top_p, "min_p": g.min_p, "repeat_penalty": g.repeat_penalty,
                    "repeat_last_n": g.repeat_last_n, "stop": list(call.stop), "stream": shape.stream}
        return attrs.evolve(self, return_tokens=shape.return_tokens, settings=settings)

    def body(self, c: Completion) -> dict:
        return {"index": 0, "content": c.text, "tokens": list(c.tokens) if self.return_tokens else [],
                "id_slot": 0, "stop": True, "model": self.model_id, "tokens_predicted": len(c.tokens),
                "tokens_evaluated": c.usage.prompt_tokens, "generation_settings": self.settings,
                "has_new_line": "\n" in c.text, "truncated": False, "stop_type": STOP_TYPE[c.finish_reason],
                "stopping_word": "", "tokens_cached": c.usage.cached_tokens,
                "timings": timings(c.stats, c.usage.cached_tokens)}

    def opening(self) -> list[str]:
        return []

    def piece(self, chunk: Chunk, n_chars: int, logprobs: bool) -> list[str]:
        return [sse({"index": 0, "content": chunk.text, "tokens": list(chunk.tokens), "stop": False, "id_slot": 0})]

    def closing(self, chunk: Chunk) -> list[str]:
        u = chunk.usage
        return [sse({"index": 0, "content": "", "tokens": [], "stop": True, "id_slot": 0, "model": self.model_id,
                     "tokens_predicted": u.completion_tokens if u else 0,
                     "tokens_evaluated": u.prompt_tokens if u else 0, "generation_settings": self.settings,
                     "has_new_line": False, "truncated": False, "stop_type": STOP_TYPE[chunk.finish_reason],
                     "stopping_word": "", "tokens_cached": u.cached_tokens if u else 0,
                     **({"timings": timings(chunk.stats, u.cached_tokens)} if chunk.stats else {})})]

    @staticmethod
    def trailer(usage_asked: bool, n_prompt: int, n_out: int) -> list[str]:
        return []  # llama-server's native stream ends with its stop event, no [DONE]

    @staticmethod
    def failed(message: str, kind: str, param: str | None = None) -> str:
        return sse(openai_error(message, kind, param))


COMPLETION = Dialect("completion", "completions", NativeReply, "cmpl-", translate)
INFILL = Dialect("infill", "completions", NativeReply, "cmpl-", translate_infill)
GENERATIONS = {"/completion": COMPLETION, "/infill": INFILL}


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


async def slots(server, request: Request) -> Response:
    """/slots: llama-server serves it only when started with --slots; Lever has no slots to show."""
    return JSONResponse(openai_error("this server does not serve /slots (one generation at a time, no slots)",
                                     "not_supported_error"), status_code=501)
