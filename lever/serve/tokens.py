"""llama.cpp's /tokenize and /detokenize, over the pipeline's tokenizer.

Beside request preparation (lever.serve.prepare, which reads and bounds their bodies as it does
a generation's), below the server's routes: plain functions, run in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable

from lever.gguf.tokenizer import Tokenizer
from lever.serve.request import BadRequest


def tokenize(tok: Tokenizer, data: dict, check_bytes: Callable[[int, str], None]) -> dict:
    """The ids of `content` (special-token text read as its token, as a completion's prompt
    is), a BOS first with `add_special`; `with_pieces`: each id's text (its bytes, when they are
    not UTF-8 on their own). `check_bytes` bounds the text before it is tokenized."""
    check_bytes(len(data["content"].encode("utf-8", "replace")), "content")
    ids = tok.encode(data["content"], add_bos=bool(data.get("add_special")))
    if not data.get("with_pieces"):
        return {"tokens": ids}

    def piece(i: int):
        b = tok.token_bytes(i)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return list(b)
    return {"tokens": [{"id": i, "piece": piece(i)} for i in ids]}


def detokenize(tok: Tokenizer, data: dict) -> dict:
    """The text of `tokens` (control tokens give no text)."""
    bad = next((i for i in data["tokens"] if not 0 <= i < tok.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"tokens: id {bad} is out of range [0, {tok.vocab_size})", "tokens")
    return {"content": tok.decode(data["tokens"])}
