"""A finished generation as the server's JSON: OpenAI's logprobs, usage, and llama.cpp's timings.

The server's last layer before the wire (lever.serve.server calls these): plain functions of a
completion's figures, so tests read them without a server. Where two conventions differ, the
field names are llama.cpp's (`timings`, /metrics), which clients and proxies already read; the
shapes of `logprobs` are OpenAI's, per endpoint (chat's `content` list, completions' parallel
lists). Every number here is finite: a rate over no time is 0, never NaN or inf.
"""

from __future__ import annotations

from collections.abc import Sequence

from lever.dataflow.messages import TokenLogprob
from lever.gguf.tokenizer import Tokenizer
from lever.pipelines.result import RunResult


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
