"""How a request speaks: the JSON its route takes in, and the shapes of its answer out.

Between the routes (lever.serve.server) and the request's preparation (lever.serve.prepare):
every generation route is a Dialect, OpenAI's two, llama-server's own (lever.serve.llama), and
the ones apps already call. A dialect translates its body into the fields preparation reads
(OpenAI's chat or completions request), so each field is checked, bounded and refused by name
in one place; its answer is a Reply-like object (lever.serve.render.Reply's methods: `body`,
and a stream's `opening`, `piece`, `closing`, `trailer`, `failed`), and its refusals have its
own form. The generation itself is the same whoever asked.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs
from starlette.responses import JSONResponse

from lever.serve.render import Reply


def openai_error(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@attrs.frozen
class Dialect:
    """One way of asking for a generation."""

    name: str
    endpoint: str  # "chat" or "completions": what the translated request is (lever.serve.request.FIELDS)
    reply: Callable  # reply(rid, chat, model_id, tok) -> the answer's shapes (a Reply-like)
    rid_prefix: str  # a response's id starts with it
    translate: Callable[[dict], dict] | None = None  # its body as the endpoint's fields; BadRequest names a field
    error_body: Callable[..., dict] = openai_error  # error_body(message, kind, param) -> its refusal's JSON

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def error(self, message: str, status: int, kind: str, param: str | None = None,
              extra: dict | None = None) -> JSONResponse:
        """Its refusal; `extra`: fields an OpenAI-style error carries beside its own (llama-server's)."""
        body = self.error_body(message, kind, param)
        if extra and isinstance(body.get("error"), dict):
            body["error"].update(extra)
        return JSONResponse(body, status_code=status)


OPENAI_CHAT = Dialect("chat", "chat", Reply, "chatcmpl-")
OPENAI_COMPLETIONS = Dialect("completions", "completions", Reply, "cmpl-")
# an absolute path in a message (a model's file, the config): not after a word, a dot or a slash,
# so a media type (application/json) or a URL's // is no path
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/(?:[^\s/:'\"]+/)+([^\s/:'\"]+)")


def public(message: str) -> str:
    """A message for a client: every absolute path in it as the file's name (a LeverError names
    the file at fault by its path; where it sits on the server's disk is no client's business)."""
    return _ABSOLUTE_PATH.sub(r"\1", message)


def refusal(message: str) -> dict:
    """`error`'s arguments for a request the API refused (a LeverError's one line): a prompt
    past the context is llama-server's exceed_context_size_error, the rest invalid requests."""
    kind = "exceed_context_size_error" if "context" in message and message.startswith(("prompt", "messages")) \
        else "invalid_request_error"
    return {"message": public(message), "status": 400, "kind": kind, "param": param_of(message)}


# a refusal of a prompt past the context: its size (tokens, or text before it was tokenized) and the context's
_OVERFLOW = re.compile(r"^(?:prompt|messages|content|input)\b\D*?(\d+) (tokens|bytes|characters)\b.*?\bcontext"
                       r"(?: size)? of (\d+)")


def overflow(message: str, max_token_bytes: int) -> dict | None:
    """llama-server's fields of a prompt past the context (exceed_context_size_error), from the
    refusal's line: n_prompt_tokens (a text refused before it was tokenized: the fewest tokens
    its bytes can be, as lever.api.render bounds it, a token at most twice the longest's bytes)
    and n_ctx; None for any other refusal."""
    m = _OVERFLOW.match(message)
    if m is None:
        return None
    n, unit, n_ctx = int(m.group(1)), m.group(2), int(m.group(3))
    n_tokens = n if unit == "tokens" else -(-n // (2 * max(max_token_bytes, 1)))
    return {"n_prompt_tokens": n_tokens, "n_ctx": n_ctx}


def param_of(message: str) -> str | None:
    """The field a LeverError's one line names first ("max_tokens: ..."), if any."""
    head = message.split(":")[0] if ":" in message[:40] else None
    return head if head and all(c.isalnum() or c in "_.[]" for c in head) else None
