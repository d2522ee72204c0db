"""Fill-in-the-middle prompts: the code before and after the cursor as the ids a FIM-trained
model reads (llama-server's /infill, Ollama's `suffix`; llama.vscode and Continue call these).

Beside the tokenizer (lever.gguf.tokenizer), below the server's dialects that take a prefix and
a suffix. A model says it knows FIM by having the tokens: Qwen2.5-Coder's `<|fim_prefix|>`,
`<|fim_suffix|>`, `<|fim_middle|>` (and `<|repo_name|>`, `<|file_sep|>` for other files as
context), CodeLlama's `<PRE>`/`<SUF>`/`<MID>`, StarCoder's `<fim_prefix>`... found by their text, as
GGUF files from Hugging Face seldom name them in the metadata. The layout is the repo-level one
Qwen2.5-Coder was trained on (arXiv 2409.12186): other files first, each after a file separator
with its name, then the current file as prefix, suffix, middle, the model writing the middle.
What the context cannot hold is cut as llama-server cuts it: the prefix keeps its end, the
suffix its start, other files give way first.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer

# each role's token texts, by the families that trained with them
TEXTS = {"prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>"),
         "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>"),
         "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>"),
         "repo": ("<|repo_name|>", "<reponame>"),
         "file": ("<|file_sep|>", "<file_sep>")}
PROJECT = "myproject"  # the repository's name the repo-level layout needs (clients do not send one)
SUFFIX_SHARE = 4  # of the room for the current file, the suffix may take a quarter, the prefix the rest


@attrs.frozen
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file: int | None = None

    @classmethod
    def of(cls, tok: Tokenizer) -> FimTokens:
        """The model's FIM tokens; one line saying the model has none."""
        ids = {}
        for role, texts in TEXTS.items():
            ids[role] = next((tok.specials.get(t, _plain_id(tok, t)) for t in texts
                              if t in tok.specials or _plain_id(tok, t) is not None), None)
        if any(ids[r] is None for r in ("prefix", "suffix", "middle")):
            raise LeverError("input_suffix: this model has no fill-in-the-middle tokens (<|fim_prefix|>, <PRE>, "
                             "...): it was not trained to fill in the middle; use a completion")
        return cls(**ids)


def _plain_id(tok: Tokenizer, text: str) -> int | None:
    """The id of a token whose whole text is `text`, when the vocabulary has it as one token."""
    ids = tok.encode(text, add_bos=False)
    return ids[0] if len(ids) == 1 and tok.token_text(ids[0]) == text else None


@attrs.frozen
class Extra:
    """Another file the cursor's file sits among: context before the current file."""

    filename: str
    text: str


def fim_ids(tok: Tokenizer, *, prefix: str, suffix: str, prompt: str = "", extra: Sequence[Extra] = (),
            n_room: int) -> list[int]:
    """The prompt ids that ask the model for the middle between `prefix` and `suffix` (then
    `prompt`, text already typed at the cursor), other files in `extra` before; at most
    `n_room` ids: the current file within the room, the other files in what it leaves."""
    fim = FimTokens.of(tok)
    pre, suf, typed = (tok.encode(t, add_bos=False) for t in (prefix, suffix, prompt))
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    fixed = len(bos) + 3 + len(typed)  # the three FIM tokens and what is typed stay whole
    room = n_room - fixed
    if room < 0:
        raise LeverError(f"prompt: {len(typed)} tokens typed at the cursor leave no room in a context of {n_room}")
    n_suf = min(len(suf), room // SUFFIX_SHARE)
    n_pre = min(len(pre), room - n_suf)
    n_suf = min(len(suf), room - n_pre)  # what the prefix left unused goes to the suffix
    current = [fim.prefix, *pre[len(pre) - n_pre:], fim.suffix, *suf[:n_suf], fim.middle, *typed]
    context = _context(tok, fim, extra)
    left = room - n_pre - n_suf
    return bos + (context[len(context) - left:] if left > 0 else []) + current


def _context(tok: Tokenizer, fim: FimTokens, extra: Sequence[Extra]) -> list[int]:
    """Other files as the repo-level layout writes them; without file separators, each after a
    plain-text snippet line; the current file's own separator last."""
    ids = [fim.repo, *tok.encode(PROJECT + "\n", add_bos=False)] if fim.repo is not None else []
    for x in extra:
        head = [fim.file, *tok.encode(x.filename + "\n", add_bos=False)] if fim.file is not None else \
            tok.encode("\n\n--- snippet ---\n\n", add_bos=False)
        ids += head + tok.encode(x.text, add_bos=False)
    if fim.file is not None:
        ids += [fim.file, *tok.encode("filename\n", add_bos=False)]
    return ids if extra or fim.file is not None else []
