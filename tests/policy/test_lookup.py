"""The free draft sources (lever.policy.lookup): prompt lookup continues the latest earlier
occurrence of the longest suffix, the n-gram cache proposes what followed a context most often,
both over the text so far followed by a node's path."""

from __future__ import annotations

import random

from lever.policy.lookup import MAX_MATCH, MIN_MATCH, Lookup


def test_prompt_lookup_continues_the_longest_earlier_match():
    lk = Lookup(("prompt-lookup",))
    lk.extend([1, 2, 3, 9, 5, 2, 3, 4, 7, 2, 3])  # "2 3" ends the text; "5 2 3" is not earlier, "2 3" is twice
    assert lk.prompt_lookup([]) == (4, 2)  # the latest earlier "2 3" was followed by 4
    assert lk.prompt_lookup([4]) == (7, 3)  # "2 3 4" (the path extends the text) was followed by 7
    assert lk.prompt_lookup([8]) is None  # "3 8" never occurred, and a single token is too short to match


def test_a_longer_match_wins_over_a_later_shorter_one():
    lk = Lookup(("prompt-lookup",))
    lk.extend([5, 6, 7, 1, 9, 6, 7, 2, 5, 6, 7])
    assert lk.prompt_lookup([]) == (1, 3)  # "5 6 7" -> 1, though the later "6 7" was followed by 2


def test_ngram_proposes_the_commonest_continuations_with_their_shares():
    lk = Lookup(("ngram",))
    lk.extend([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    got = lk.ngram([])
    assert got == [(3, 2 / 4), (4, 1 / 4)]  # after "1 2": 3 twice, 4 once (and one unseen)
    assert [s for s, *_ in lk.propose([])] == ["ngram", "ngram"]


def test_indexing_token_by_token_equals_indexing_at_once():
    rng = random.Random(0)
    text = [rng.randrange(6) for _ in range(300)]
    a, b = Lookup(("prompt-lookup", "ngram")), Lookup(("prompt-lookup", "ngram"))
    a.extend(text)
    for t in text:
        b.extend([t])
    for path in ([], [1], [2, 3], [5, 5, 5]):
        assert a.propose(path) == b.propose(path)


def test_prompt_lookup_matches_a_brute_force_search():
    rng = random.Random(1)
    for _ in range(200):
        text = [rng.randrange(4) for _ in range(rng.randrange(2, 60))]
        path = [rng.randrange(4) for _ in range(rng.randrange(0, 4))]
        lk = Lookup(("prompt-lookup",))
        lk.extend(text)
        full = text + path
        want = None
        for n in range(min(MAX_MATCH, len(full) - 1), MIN_MATCH - 1, -1):
            suffix = full[-n:]
            ends = [e for e in range(n - 1, len(text) - 1) if text[e - n + 1 : e + 1] == suffix]
            if ends:
                want = (text[ends[-1] + 1], n)
                break
        assert lk.prompt_lookup(path) == want, (text, path)


def test_trials_score_each_emitted_token_against_what_each_source_proposed_there():
    lk = Lookup(("prompt-lookup", "ngram"))
    lk.extend([1, 2, 3, 1, 2, 3, 1, 2])
    got = lk.trials([3, 9])
    # after the text: lookup says 3 (it matched "1 2 3 1 2", 5 long), the n-gram cache 3 (twice
    # after "1 2"); one token on, lookup says 1 (6 long) and so does the cache (twice after
    # "2 3"): 9 came, so both were wrong
    assert got == [("prompt-lookup", 5 / MAX_MATCH, 0, True), ("ngram", 2 / 3, 0, True),
                   ("prompt-lookup", 6 / MAX_MATCH, 0, False), ("ngram", 2 / 3, 0, False)]
    assert lk.tokens == [1, 2, 3, 1, 2, 3, 1, 2]  # scoring does not extend the text
