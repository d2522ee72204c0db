"""Why a generation ends: the reasons, listed once, and the rule both decoders apply.

Accept (a pipeline's last stage) and lever.model.generate (one model's autoregressive loop)
end a generation by `stop_reason`, so a speculative run stops exactly where autoregressive
decoding does. A caller's own rule (a stop string completed, a request cancelled: lever.api)
answers with a reason of the same list, and the server maps each to OpenAI's finish_reason.
"""

from __future__ import annotations

import enum


class StopReason(enum.StrEnum):
    EOS = "eos"  # the model's end-of-generation token
    LENGTH = "length"  # n_predict tokens emitted
    CONTEXT = "context"  # no row left in the context for the next token
    STOP = "stop"  # a stop string completed (the caller's rule)
    CANCELLED = "cancelled"  # the caller cancelled


def stop_reason(token: int, *, n_emitted: int, n_predict: int, n_rows: int, n_ctx: int,
                eos_ids: frozenset[int]) -> StopReason | None:
    """After emitting `token`, the n_emitted-th: why the generation ends there (None: it goes on).
    `n_rows` is the context's rows in use, of n_ctx: the text stops when it fills the context,
    prompt and reply, so all of it fits there to go on from (llama-server's count)."""
    if token in eos_ids:
        return StopReason.EOS
    if n_emitted >= n_predict:
        return StopReason.LENGTH
    if n_rows + 1 >= n_ctx:
        return StopReason.CONTEXT
    return None
