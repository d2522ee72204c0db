"""A generation as the server's JSON: OpenAI's responses and stream chunks (`Reply`), logprobs,
usage, and llama.cpp's timings.

The server's last layer before the wire (lever.serve.server calls these): plain functions of a
completion's figures, so tests read them without a server. Where two conventions differ, the
field names are llama.cpp's (`timings`, /metrics), which clients and proxies already read; the
shapes of `logprobs` are OpenAI's, per endpoint (chat's `content` list, completions' parallel
lists). Every number here is finite: a rate over no time is 0, never NaN or inf.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import attrs

from lever.api import Chunk, Completion
from lever.dataflow.messages import TokenLogprob
from lever.gguf.tokenizer import Tokenizer
from lever.model.stop import StopReason
from lever.pipelines.result import RunResult
from lever.serve.webui import BUILD

# OpenAI's finish_reason of each of Lever's (lever.model.stop); a generation cut by shutdown is
# never reported as finished (lever.serve.server: 503, or an error event in a stream)
OPENAI_FINISH = {StopReason.STOP: "stop", StopReason.EOS: "stop", StopReason.LENGTH: "length",
                 StopReason.CONTEXT: "length", StopReason.CANCELLED: "stop"}


FINGERPRINT = BUILD  # OpenAI's system_fingerprint: which backend answered, as llama-server's build string


@attrs.frozen
class Reply:
    """One request's answer in OpenAI's shapes: a whole response, or a stream's events. Every
    dialect's answer (lever.serve.dialect) has these methods: `body`, and for a stream
    `opening`, `piece`, `closing`, `trailer`, `failed`, each a list of events (or one)."""

    rid: str  # "chatcmpl-..." / "cmpl-..."
    chat: bool
    model_id: str
    tok: Tokenizer
    index: int = 0  # the choice's (several prompts or `n`: lever.serve.server runs them one after another)
    native: object = None  # llama-server's answer (lever.serve.llama.NativeReply) as its __verbose, when asked
    media_type = "text/event-stream"

    def opening(self) -> list[str]:
        """A chat stream's first event: the role, its content null (as OpenAI's and llama-server's)."""
        return [self.chunk({"role": "assistant", "content": None}, None)] if self.chat else []

    def piece(self, chunk: Chunk, n_chars: int, logprobs: bool) -> list[str]:
        """A chunk's text (and its tokens' logprobs, `n_chars` into the text)."""
        lps = self.logprobs(chunk.logprobs, n_chars) if logprobs else None
        return [self.chunk({"content": chunk.text} if self.chat else chunk.text, None, lps)]

    def progress(self, fields: dict) -> list[str]:
        """llama-server's prompt_progress report (lever.serve.progress), on a chunk of no text
        (a chat's with the role, as llama-server's)."""
        delta = {"role": "assistant", "content": None} if self.chat else ""
        return [self.chunk(delta, None, extra=fields)]

    def closing(self, chunk: Chunk) -> list[str]:
        """The last chunk: the calls a chat's reply made, why it ended, llama.cpp's timings."""
        out, finish = [], OPENAI_FINISH[chunk.finish_reason]
        if chunk.tool_calls:
            finish = finish if chunk.finish_reason is StopReason.LENGTH else "tool_calls"
            out.append(self.chunk({"tool_calls": [tc.as_openai(i) for i, tc in enumerate(chunk.tool_calls)]}, None))
        extra = {"timings": timings(chunk.stats, chunk.usage.cached_tokens)} if chunk.stats else {}
        return [*out, self.chunk({} if self.chat else "", finish, extra=extra)]

    def trailer(self, usage_asked: bool, n_prompt: int, n_out: int) -> list[str]:
        return [*([self.usage_chunk(n_prompt, n_out)] if usage_asked else []), "data: [DONE]\n\n"]

    @staticmethod
    def failed(message: str, kind: str, param: str | None = None) -> str:
        """A stream that fails mid-way ends with an error event, as OpenAI's do; no [DONE]."""
        return sse({"error": {"message": message, "type": kind, "param": param, "code": None}})

    def object(self, chunk: bool) -> str:
        return ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"

    def logprobs(self, logprobs: Sequence[TokenLogprob], text_offset: int = 0) -> dict:
        return chat_logprobs(self.tok, logprobs) if self.chat else completion_logprobs(self.tok, logprobs, text_offset)

    def chunk(self, delta, finish: str | None, logprobs: dict | None = None, extra: dict | None = None) -> str:
        """One SSE event of a stream: a chat's `delta` (a dict) or a completion's text."""
        choice = {"index": self.index, "finish_reason": finish, "logprobs": logprobs}
        choice.update({"delta": delta} if self.chat else {"text": delta})
        return sse({"id": self.rid, "object": self.object(True), "created": int(time.time()), "model": self.model_id,
                    "system_fingerprint": FINGERPRINT, "choices": [choice], **(extra or {})})

    def usage_chunk(self, n_prompt: int, n_out: int) -> str:
        """A stream's last event when `stream_options.include_usage` asks for it."""
        return sse({"id": self.rid, "object": self.object(True), "created": int(time.time()),
                    "model": self.model_id, "choices": [], "usage": usage(n_prompt, n_out)})

    def body(self, c: Completion) -> dict:
        """A whole response (a chat's tool calls as `message.tool_calls`)."""
        lps = self.logprobs(c.logprobs) if c.logprobs is not None else None
        choice = {"index": self.index, "finish_reason": OPENAI_FINISH[c.finish_reason], "logprobs": lps}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            if c.tool_calls:  # OpenAI's shape: no text is null, and the reason says why it ended
                choice["message"] = {"role": "assistant", "content": c.text or None,
                                     "tool_calls": [tc.as_openai() for tc in c.tool_calls]}
                if c.finish_reason is not StopReason.LENGTH:  # a reply cut by its limit says so
                    choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = c.text
        out = {"id": self.rid, "object": self.object(False), "created": int(time.time()), "model": self.model_id,
               "system_fingerprint": FINGERPRINT, "choices": [choice],
               "usage": usage(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_tokens),
               "timings": timings(c.stats, c.usage.cached_tokens)}
        if self.native is not None:  # llama-server's debugging fields: its own answer, the prompt as read
            out["__verbose"] = self.native.body(c)
        return out


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _per(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def timings(res: RunResult, n_cached: int = 0) -> dict:
    """llama.cpp's `timings`, from a run's figures: `prompt_*` the prefill (the prompt tokens
    not taken from a session's caches, to the first token), `predicted_*` the tokens after the
    first (decoding), `draft_n` the draft tokens grown into trees and `draft_n_accepted` those
    the target kept; then Lever's own: passes, tokens per pass, tree nodes, flash bytes."""
    t, out = res.timing, res.output
    n_prompt, n_out = len(res.prompt_tokens), len(out.tokens)
    d = {"cache_n": n_cached, "prompt_n": n_prompt, "prompt_ms": 1e3 * t.prefill_s,
         "prompt_per_token_ms": _per(1e3 * t.prefill_s, n_prompt), "prompt_per_second": _per(n_prompt, t.prefill_s),
         "predicted_n": n_out, "predicted_ms": 1e3 * t.decode_s,
         "predicted_per_token_ms": _per(1e3 * t.decode_s, n_out - 1), "predicted_per_second": res.decode_tps}
    if res.draft is not None or any(s > 1 for s in res.trees.tree_sizes):
        d.update(draft_n=res.trees.drafted_nodes, draft_n_accepted=out.drafted_kept)
    d.update(passes=t.n_passes, tokens_per_pass=out.tokens_per_pass, tree_nodes=res.trees.mean_nodes,
             flash_mb_read=res.flash.read_bytes / 1e6)
    return d


def _piece(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(token)
    return b.decode("utf-8", "replace"), list(b)


def shown(tok: Tokenizer, logprobs: Sequence[TokenLogprob]) -> list[TokenLogprob]:
    """The tokens a client sees: the end-of-turn token is not text, so not listed."""
    eos = frozenset(tok.eos_ids)
    return [lp for lp in logprobs if lp.token not in eos]


def chat_logprobs(tok: Tokenizer, logprobs: Sequence[TokenLogprob]) -> dict:
    """OpenAI chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = _piece(tok, token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
               for lp in shown(tok, logprobs)]
    return {"content": content, "refusal": None}


def completion_logprobs(tok: Tokenizer, logprobs: Sequence[TokenLogprob], text_offset: int = 0) -> dict:
    """OpenAI completions' `logprobs`: parallel lists of tokens, their logprobs, the top
    alternatives (a {token: logprob} each) and each token's offset in the text (characters,
    from `text_offset`: where this piece starts in a stream)."""
    tokens, offsets, raw = [], [], b""
    lps = shown(tok, logprobs)
    for lp in lps:
        offsets.append(text_offset + len(raw.decode("utf-8", "ignore")))
        text, b = _piece(tok, lp.token)
        tokens.append(text)
        raw += bytes(b)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_piece(tok, t)[0]: v for t, v in lp.top} for lp in lps], "text_offset": offsets}
