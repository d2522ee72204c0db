"""Draft sources that cost nothing: prompt lookup and the session's n-gram cache.

TreeExpand's builder asks these for the children of the root and of the nodes they proposed,
has a draft forward read their chain below a node it expands (one forward for a run of text
that repeats, instead of one per token), and lets them fill the tree once the draft model's
tree is done (or grow it alone: `[model] draft = ""` with sources without "model"): they cost
no drafting, so they add width to the pass and never take the model's place. Both read the
text so far: the prompt and every token emitted since.

    prompt-lookup  the token that followed the latest earlier occurrence of the longest suffix
                   of the node's text (2 to MAX_MATCH tokens long): text that repeats (code the
                   prompt contains and the answer edits, a document being summarized) continues
                   as it did. Its `q` is the match's length over MAX_MATCH, a confidence the
                   acceptance table maps to a measured acceptance.
    ngram          the tokens that followed the node's last NGRAM_N tokens (or fewer, when that
                   context was never seen), by count: the text's own habits. Its `q` is the
                   count's share with one unseen continuation added (c / (n + 1)): a context
                   seen twice with the same follower is not a certainty.

Each source's proposals go through an acceptance table of its own, so a source that misleads
on some text stops being used there. The tables learn from the text itself, not from the tree:
every token Accept emits is a trial of what each source would have proposed at its position
(`trials`), whether or not that proposal joined the tree. Their cost is nothing, and a table
learned from tree trials alone would see only the proposals it already rated high (and none at
all from a source it had stopped trusting). They are proposals only: the target verifies
everything, so output is the target's own whatever they propose.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import attrs

from lever.policy.growth import Source

SOURCES = tuple(Source)  # [tree_expand] sources: the names
MAX_MATCH = 8  # longest suffix prompt lookup matches: past it, longer matches say little more
MIN_MATCH = 2  # a single token repeats too often to predict what follows it
NGRAM_N = 3  # context of the n-gram cache
NGRAM_CHILDREN = 2  # continuations the n-gram cache proposes per node
MIN_COUNT = 2  # an n-gram context seen once is prompt lookup's job


@attrs.define
class Lookup:
    """The text so far, indexed: for each n-gram (n <= MAX_MATCH) the positions it ends at, and
    for each context (n <= NGRAM_N) the counts of the tokens after it. `extend` adds tokens as
    Accept emits them; `propose` answers for a node's path."""

    sources: tuple[Source, ...] = attrs.field(converter=lambda xs: tuple(Source(x) for x in xs))  # no MODEL
    tokens: list[int] = attrs.field(factory=list)
    _ends: dict = attrs.field(factory=lambda: defaultdict(list))  # n-gram tuple -> end positions, rising
    _next: dict = attrs.field(factory=lambda: defaultdict(Counter))  # context tuple -> Counter of next tokens

    def extend(self, new: list[int]) -> None:
        for t in new:
            self.tokens.append(int(t))
            i = len(self.tokens) - 1  # the position just added ends n-grams and follows contexts
            for n in range(1, MAX_MATCH + 1):
                if i - n + 1 < 0:
                    break
                self._ends[tuple(self.tokens[i - n + 1 : i + 1])].append(i)
            for n in range(1, NGRAM_N + 1):
                if i - n < 0:
                    break
                self._next[tuple(self.tokens[i - n : i])][self.tokens[i]] += 1

    def trials(self, new: list[int]) -> list[tuple[Source, float, int, bool]]:
        """(source, q, rank, right) of every proposal the sources make at each position of
        `new`, the tokens about to be appended (call before `extend`): right when it is the
        token that came."""
        out = []
        for i, t in enumerate(new):
            out += [(source, q, rank, tok == t) for source, tok, q, rank in self.propose(new[:i])]
        return out

    def propose(self, path: list[int]) -> list[tuple[Source, int, float, int]]:
        """(source, token, q, rank) children for the text so far followed by `path` (the tree's
        tokens below the root, the root being the last token of the text)."""
        out = []
        for source in self.sources:
            if source == Source.PROMPT_LOOKUP:
                hit = self.prompt_lookup(path)
                if hit is not None:
                    out.append((source, hit[0], hit[1] / MAX_MATCH, 0))
            elif source == Source.NGRAM:
                out += [(source, t, q, r) for r, (t, q) in enumerate(self.ngram(path))]
        return out

    def _suffix(self, path: list[int], n: int) -> tuple[int, ...]:
        if n <= len(path):
            return tuple(path[len(path) - n :])
        k = n - len(path)
        return tuple(self.tokens[len(self.tokens) - k :]) + tuple(path) if k <= len(self.tokens) else ()

    def prompt_lookup(self, path: list[int]) -> tuple[int, int] | None:
        """(the token after the latest earlier occurrence of the longest suffix, its length)."""
        last = len(self.tokens) - 1
        for n in range(min(MAX_MATCH, len(self.tokens) + len(path) - 1), MIN_MATCH - 1, -1):
            key = self._suffix(path, n)
            if len(key) < n:
                continue
            ends = self._ends.get(key)
            if not ends:
                continue
            # the latest occurrence with a token after it, other than the suffix itself
            for e in reversed(ends):
                if e < last and (path or e != last):
                    return self.tokens[e + 1], n
        return None

    def ngram(self, path: list[int]) -> list[tuple[int, float]]:
        """The likeliest tokens after the longest context seen MIN_COUNT times, with their shares."""
        for n in range(NGRAM_N, 0, -1):
            key = self._suffix(path, n)
            if len(key) < n:
                continue
            counts = self._next.get(key)
            if not counts:
                continue
            total = sum(counts.values())
            if total < MIN_COUNT:
                continue
            return [(t, c / (total + 1)) for t, c in counts.most_common(NGRAM_CHILDREN)]
        return []
