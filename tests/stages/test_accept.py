"""Accept's walk along the target's choices, with a fake lm_head."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.dataflow.messages import Expansion, TokenTree
from lever.model.sampling import DRAWS, SamplingParams, distribution, draw_without_replacement, sample
from lever.model.transformer import HEAD_ROWS
from lever.policy.cost import FlatCost
from lever.policy.predictor import prune_by_scores
from lever.stages.accept import accept_tree
from lever.tree.builder import TreeBuilder
from lever.tree.config import TreeExpandConfig
from tests.sizes import cases

VOCAB = 50


def logits_choosing(choice: dict[int, int]):
    """lm_head stand-in: the target picks choice[node] at each node; records each batch."""
    calls = []

    def fn(nodes):
        calls.append(list(nodes))
        out = np.zeros((len(nodes), VOCAB), np.float32)
        for r, node in enumerate(nodes):
            out[r, choice.get(node, 0)] = 1.0
        return out

    return fn, calls


def tree():
    # root 0 -> children 1 (tok 7, likelier) and 2 (tok 8); 1 -> 3 (tok 9); 2 -> 4 (tok 3)
    return TokenTree(1, np.array([5, 7, 8, 9, 3]), np.array([-1, 0, 0, 1, 2], np.int32),
                     gains=np.array([1.0, 0.6, 0.3, 0.5, 0.2], np.float32))


def walk(choice, budget=100, eos=frozenset()):
    fn, calls = logits_choosing(choice)
    return (*accept_tree(tree(), fn, SamplingParams(), rng=np.random.default_rng(0), budget=budget, eos_ids=eos), calls)


def test_the_likely_path_goes_in_one_batch():
    toks, keep, rows, calls = walk({0: 7, 1: 9, 3: 11})
    assert toks == [7, 9, 11] and keep == [0, 1, 3] and rows == 3 and calls == [[0, 1, 3]]


def test_a_long_path_runs_the_head_in_batches_the_plan_counts():
    """A chain deeper than HEAD_ROWS, accepted whole: the head runs batch after batch along it,
    none over HEAD_ROWS rows, each row once, and the walk emits every token and the bonus."""
    n = 2 * HEAD_ROWS + 7
    chain = TokenTree(1, np.arange(n) % VOCAB, np.arange(-1, n - 1, dtype=np.int32),
                      gains=np.linspace(1, 0.1, n).astype(np.float32))
    fn, calls = logits_choosing({i: int(chain.tokens[i + 1]) for i in range(n - 1)} | {n - 1: 11})
    toks, keep, rows = accept_tree(chain, fn, SamplingParams(), rng=np.random.default_rng(0), budget=100,
                                   eos_ids=frozenset())
    assert toks == [*(int(t) for t in chain.tokens[1:]), 11] and keep == list(range(n)) and rows == n
    assert [len(c) for c in calls] == [HEAD_ROWS, HEAD_ROWS, n - 2 * HEAD_ROWS]
    assert sum(calls, []) == list(range(n))


def test_leaving_the_likely_path_starts_a_batch_at_the_fork():
    toks, keep, rows, calls = walk({0: 8, 2: 3, 4: 11})
    assert toks == [8, 3, 11] and keep == [0, 2, 4]
    assert calls == [[0, 1, 3], [2, 4]] and rows == 5  # rows 1 and 3 were computed in vain


def test_first_miss_stops_with_the_targets_token():
    toks, keep, _, _ = walk({0: 30})
    assert toks == [30] and keep == [0]


def test_budget_and_eos_stop_the_walk():
    toks, _, rows, calls = walk({0: 7, 1: 9, 3: 1}, budget=1)
    assert toks == [7] and calls == [[0]] and rows == 1  # no row past what may still be emitted
    assert walk({0: 7, 1: 9, 3: 1}, budget=9, eos=frozenset({7}))[0] == [7]


# -- speculative sampling keeps the target's distribution, through real trees

V = 4  # vocabulary of the synthetic models: 4**3 outcomes for three tokens
N_TOKENS = 3
TRIALS = 6000
P_FLOOR = 1e-4  # chance that an exact sampler fails the test with these seeds: below this


def synthetic(prefix: tuple[int, ...], salt: int) -> np.ndarray:
    """A fixed next-token distribution for every prefix (salt 1: the target, 2: the draft)."""
    return np.random.default_rng([salt, *prefix]).dirichlet(np.full(V, 0.6))


def grammar(path: tuple[int, ...]) -> np.ndarray:
    """A synthetic grammar: after `path` (the tokens since the start), a token t is allowed when
    sum(path) + t is not a multiple of 3 (one or two of the V tokens are forbidden each time)."""
    return np.array([(sum(path) + t) % 3 != 0 for t in range(V)])


def constrained(p: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    p = np.where(allowed, p, 0.0)
    return p / p.sum()


class SamplingDraft:
    """Draws each expanded node's children from the synthetic draft, as Draft does when sampling."""

    def __init__(self, prefix, rng, masked: bool = False):
        self.prefix, self.rng, self.paths, self.masked = tuple(prefix), rng, [], masked

    def rows(self, req) -> np.ndarray:
        """The request's tokens appended to the paths kept; the rows to expand."""
        if req.keep is not None:
            self.paths = []
        for tok, parent in zip(req.tokens.tolist(), req.parents.tolist()):
            self.paths.append(self.prefix if parent < 0 else self.paths[parent] + (tok,))
        return np.arange(len(self.paths) - req.tokens.size + req.n_given, len(self.paths), dtype=np.int32)

    def __call__(self, req):
        rows = self.rows(req)
        q = np.stack([constrained(synthetic(self.paths[r], 2), grammar(self.paths[r][1:])) if self.masked else
                      synthetic(self.paths[r], 2) for r in rows]).astype(np.float32)
        toks = np.full((rows.size, req.top_k), -1, np.int64)
        for i in range(rows.size):
            d = draw_without_replacement(q[i], req.top_k, self.rng)
            toks[i, : d.size] = d
        probs = np.where(toks >= 0, np.take_along_axis(q, np.maximum(toks, 0), 1), 0).astype(np.float32)
        return Expansion(req.cycle, rows, toks, probs, q)


def speculative_sample(rng, config, prune: bool = False, masked: bool = False,
                       params: SamplingParams = SamplingParams(temperature=1.0, draws="rejection")) -> tuple[int, ...]:
    """N_TOKENS tokens by cycles of draft tree + rejection-sampling Accept, from prefix (0,);
    with prune, random branches are pruned as a predictor might (never the backbone); with
    masked, under the synthetic grammar: the draft draws from its masked distribution (as Draft
    does) and Accept chooses among the allowed tokens. `params`: the target's sampling (its
    logit bias and penalties over the text so far, the prefix its first token)."""
    prefix = (0,)
    while len(prefix) - 1 < N_TOKENS:
        b = TreeBuilder(config, FlatCost(read_s=1.0, compute_per_token_s=1e-4, draft_step_s=1e-3), 1, room=100)
        b.add(prefix[-1], -1, 1.0)
        # test_vocab_map swaps SamplingDraft for a two-argument one
        draft = SamplingDraft(prefix, rng, masked=True) if masked else SamplingDraft(prefix, rng)
        req = b.request([0], [], keep=())
        while req is not None:
            req = b.on_expansion(draft(req))
        t = b.tree(1, ())

        def logits_at(nodes):
            out = []
            for n in nodes:
                path = []
                while n > 0:
                    path.append(int(t.tokens[n]))
                    n = int(t.parents[n])
                out.append(np.log(synthetic(prefix + tuple(reversed(path)), 1)))
            return np.array(out)

        alive = prune_by_scores(t, rng.random(t.n_nodes), 0.5, 1.0) if prune else None
        allowed = (lambda walked, at=prefix: grammar(at[1:] + tuple(walked))) if masked else None
        toks, _, _ = accept_tree(t, logits_at, params, rng=rng, budget=N_TOKENS - len(prefix) + 1,
                                 eos_ids=frozenset(), alive=alive, allowed=allowed, history=prefix)
        prefix += tuple(toks)
    return prefix[1:]


def chi_square_vs_target(samples, masked: bool = False, params: SamplingParams | None = None) -> tuple[float, float]:
    """Pearson's statistic over all V**N_TOKENS sequences (those the grammar allows, when
    masked: the others must never come), and its 1 - P_FLOOR quantile (Wilson-Hilferty:
    accurate to a few percent at these degrees of freedom)."""
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    stat, n_seqs = 0.0, 0
    for seq in np.ndindex(*(V,) * N_TOKENS):
        p, prefix = 1.0, (0,)
        for tok in seq:
            dist = synthetic(prefix, 1)
            if params is not None:  # the target shaped by the text so far
                dist = distribution(np.log(dist), params, prefix)
            p *= (constrained(dist, grammar(prefix[1:])) if masked else dist)[tok]
            prefix += (tok,)
        if p == 0.0:
            assert tuple(seq) not in counts, f"{seq}: the grammar forbids it, yet it was sampled"
            continue
        n_seqs += 1
        want = p * len(samples)
        stat += (counts.get(tuple(seq), 0) - want) ** 2 / want
    df, z = n_seqs - 1, 3.72  # z: the normal quantile of 1 - P_FLOOR
    return stat, df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("draws", DRAWS)
def test_tree_speculative_sampling_matches_the_targets_distribution(draws):
    """Either way of drawing: llama.cpp's (the target's own choice at each node, the walk into the
    child holding it) or rejection sampling over the draft's draws."""
    rng = np.random.default_rng(1)
    config = TreeExpandConfig(policy="gain-cost", max_nodes=8, max_depth=3, top_k=3, round_nodes=4)
    params = SamplingParams(temperature=1.0, draws=draws)
    samples = [speculative_sample(rng, config, params=params) for _ in range(TRIALS)]
    stat, limit = chi_square_vs_target(samples)
    assert stat < limit, f"chi-square {stat:.1f} over the {limit:.1f} an exact sampler stays under"
    assert np.mean([len(s) for s in samples]) == N_TOKENS


@pytest.mark.parametrize("draws", DRAWS)
def test_pruned_trees_keep_the_targets_distribution(draws):
    """Pruning only stops the walk early: a pruned child chosen by the target is the bonus token."""
    rng = np.random.default_rng(2)
    config = TreeExpandConfig(policy="gain-cost", max_nodes=8, max_depth=3, top_k=3, round_nodes=4)
    params = SamplingParams(temperature=1.0, draws=draws)
    stat, limit = chi_square_vs_target([speculative_sample(rng, config, prune=True, params=params)
                                        for _ in range(TRIALS)])
    assert stat < limit, f"chi-square {stat:.1f} over the {limit:.1f} an exact sampler stays under"


@pytest.mark.parametrize("draws", DRAWS)
def test_under_a_grammar_sampling_keeps_the_constrained_distribution(draws):
    """The target's distribution masked by the grammar at every node (lever.model.grammar's job
    in Accept), the draft's drawn from its own masked distribution: exactly constrained sampling."""
    rng = np.random.default_rng(3)
    config = TreeExpandConfig(policy="gain-cost", max_nodes=8, max_depth=3, top_k=3, round_nodes=4)
    params = SamplingParams(temperature=1.0, draws=draws)
    samples = [speculative_sample(rng, config, masked=True, params=params) for _ in range(TRIALS)]
    stat, limit = chi_square_vs_target(samples, masked=True)
    assert stat < limit, f"chi-square {stat:.1f} over the {limit:.1f} an exact sampler stays under"


@pytest.mark.parametrize("draws", DRAWS)
def test_with_a_logit_bias_and_penalties_sampling_keeps_the_shaped_distribution(draws):
    """Each node's row biased and penalized by that node's own text (the prefix, then the path
    down to it): the sequences come as often as the shaped target's own draws would give them,
    and a banned token, which the draft still draws, never comes."""
    rng = np.random.default_rng(4)
    params = SamplingParams(temperature=1.0, repeat_penalty=1.5, repeat_last_n=2, presence_penalty=0.4,
                            frequency_penalty=0.3, logit_bias=[(1, 0.8), (3, -math.inf)], draws=draws)
    config = TreeExpandConfig(policy="gain-cost", max_nodes=8, max_depth=3, top_k=3, round_nodes=4)
    samples = [speculative_sample(rng, config, params=params) for _ in range(TRIALS)]
    assert not any(3 in s for s in samples)
    stat, limit = chi_square_vs_target(samples, params=params)
    assert stat < limit, f"chi-square {stat:.1f} over the {limit:.1f} an exact sampler stays under"


def test_the_distribution_test_catches_a_biased_verifier(monkeypatch):
    """Control: the classic mistake (on rejection, resample from p instead of the residual)."""
    import lever.stages.accept as accept

    def naive(p, drawn, q, rng):
        for j, x in enumerate(drawn):
            q_x = 1.0 if q is None else q[x] / q.sum()
            if rng.random() * q_x < p[x]:
                return int(x), j
        return int(rng.choice(p.size, p=p)), -1

    monkeypatch.setattr(accept, "rejection_sample", naive)
    rng = np.random.default_rng(1)
    config = TreeExpandConfig(policy="gain-cost", max_nodes=8, max_depth=3, top_k=3, round_nodes=4)
    params = SamplingParams(temperature=1.0, draws="rejection")
    stat, limit = chi_square_vs_target([speculative_sample(rng, config, params=params) for _ in range(TRIALS)])
    assert stat > limit


# -- greedy under a logit bias and penalties: the walk emits autoregressive decoding's tokens

V_PEN = 6  # a small vocabulary: tokens come again, so the penalties have counts to work on


def target_row(text) -> np.ndarray:
    """The synthetic target's logits after `text`."""
    return np.random.default_rng([9, *text]).normal(0.0, 2.0, V_PEN).astype(np.float32)


def autoregressive(prefix, n: int, params: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        text = [*prefix, *out]
        out.append(sample(target_row(text), params, np.random.default_rng(0), text))
    return out


shaping = st.builds(
    SamplingParams,
    repeat_penalty=st.floats(0.5, 3.0), repeat_last_n=st.sampled_from([0, 1, 3, 64]),
    presence_penalty=st.floats(-3, 3, allow_subnormal=False), frequency_penalty=st.floats(-3, 3, allow_subnormal=False),
    logit_bias=st.lists(st.tuples(st.integers(0, V_PEN - 1), st.one_of(st.floats(-8, 8, allow_subnormal=False),
                                                                       st.just(False))), max_size=V_PEN - 1))


@settings(max_examples=cases(200), deadline=None)
@given(params=shaping, prefix=st.lists(st.integers(0, V_PEN - 1), min_size=1, max_size=8),
       follow=st.integers(0, 6), n_branches=st.integers(0, 12), budget=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_greedy_under_a_bias_and_penalties_is_autoregressive_greedy(params, prefix, follow, n_branches, budget, seed):
    """A tree holding the shaped target's own next `follow` tokens as a chain, with branches of
    random tokens anywhere and random gains (so the likely path leaves the chain): the walk takes
    the chain, each node shaped by its own text, and emits exactly the autoregressive tokens."""
    chain = autoregressive(prefix, follow, params)
    tokens, parents = [prefix[-1], *chain], [-1, *range(follow)]
    rng = np.random.default_rng(seed)
    for _ in range(n_branches):
        parent, tok = int(rng.integers(len(tokens))), int(rng.integers(V_PEN))
        if all(tokens[c] != tok for c in range(1, len(tokens)) if parents[c] == parent):
            tokens.append(tok)
            parents.append(parent)
    t = TokenTree(1, np.array(tokens), np.array(parents, np.int32), gains=rng.random(len(tokens)).astype(np.float32))

    def text_at(n):
        path = []
        while n > 0:
            path.append(int(t.tokens[n]))
            n = int(t.parents[n])
        return [*prefix, *reversed(path)]

    out, _, _ = accept_tree(t, lambda nodes: np.stack([target_row(text_at(n)) for n in nodes]), params,
                               rng=np.random.default_rng(0), budget=budget, eos_ids=frozenset(), history=prefix)
    assert out == autoregressive(prefix, len(out), params)
    assert len(out) >= min(budget, follow + 1)  # the chain whole (a branch may hold the next token too)
