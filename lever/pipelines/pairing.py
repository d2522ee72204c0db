"""Which source drafts for a target named by path alone: `lever run -m T.gguf [-md D.gguf]`, the
same on serve, chat and the benches, and `lever.load(target=..., draft=...)`.

Above the config (its overrides are what this decides) and the vocabulary map (lever.gguf.vocab_map,
which says whether a draft's tokens can stand for the target's), below the commands and the API.
A llama.cpp user points Lever at a model and expects it to run: without a draft, or with one
whose tokenizer would cut text differently, the tree is grown from the free sources (prompt
lookup and the n-gram cache: lever.policy.lookup), which need no second model and are lossless
all the same; the run says so in one line rather than refusing. A draft file that is missing or
not a GGUF is still an error: that is a typo, not a pair.
"""

from __future__ import annotations

import json

import attrs

from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.vocab_map import pair_vocabularies
from lever.policy.growth import Source

FREE = (Source.PROMPT_LOOKUP, Source.NGRAM)  # the sources that need no draft model


@attrs.frozen
class Pairing:
    """What the config is told (`section.key=value` overrides, as --set takes them) and the
    line that says why the draft given is not used (None: nothing to say)."""

    sets: tuple[str, ...]
    note: str | None = None


def free_sets() -> tuple[str, ...]:
    """A speculative pipeline drafting from the free sources alone (no draft model loaded)."""
    return ('model.draft=""', f"tree_expand.sources={json.dumps([str(s) for s in FREE])}")


def pair(target: str, draft: str | None) -> Pairing:
    """The overrides for `target` with `draft` (a path; None or "": none given)."""
    sets = (f"model.target={json.dumps(str(target))}", 'pipeline.kind="speculative"')
    if not draft:
        return Pairing((*sets, *free_sets()),
                       "no draft model given (-md): drafting from the prompt and the text so far "
                       "(prompt lookup, n-grams)")
    why = unpairable(target, draft)
    if why is not None:
        return Pairing((*sets, *free_sets()),
                       f"the draft {draft} cannot propose for this target ({why}): drafting from the prompt "
                       "and the text so far (prompt lookup, n-grams)")
    return Pairing((*sets, f"model.draft={json.dumps(str(draft))}"))


def unpairable(target: str, draft: str) -> str | None:
    """Why `draft`'s tokens cannot stand for `target`'s (None: they can, mapped or as they are).
    A file that is not there or not a GGUF raises: that is the user's to fix."""
    t, d = GGUFFile(target), GGUFFile(draft)
    try:
        pair_vocabularies(t, d)
    except LeverError as e:
        parts = str(e).split(": ")  # "{the files}: {why}: {what follows}": the why alone
        return (parts[1] if len(parts) > 1 else parts[0])[:160]
    return None
