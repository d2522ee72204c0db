"""TreeExpand's cycles without an event loop, through its core (lever.tree.cycle.TreeCycle and its
learning, lever.tree.learning.TreeLearner): a fake draft answers expansions (the builder alone:
tests/tree). Nothing here writes a private attribute."""

from __future__ import annotations

import numpy as np
import pytest

from lever.dataflow.messages import Accepted, Expansion
from lever.errors import LeverError
from lever.policy.cost import FlatCost
from lever.policy.fallback import TREE
from lever.tree import lookahead
from lever.tree.builder import TreeBuilder
from lever.tree.config import TreeExpandConfig
from lever.tree.cycle import TreeCycle
from lever.tree.free import FreeSources
from lever.tree.learning import TreeLearner
from tests.tree.fake_draft import FakeDraft


def test_next_cycle_commits_the_expanded_accepted_path_and_feeds_an_unexpanded_leaf():
    cycle = TreeCycle.for_run(TreeExpandConfig(policy="chain", chain_length=2), [1, 2, 3])
    acc = Accepted(0, (5,), (0, 1, 2))  # after the prefill of 3 tokens
    b, req = cycle.start(acc)
    assert req.keep == (0, 1, 2) and req.tokens.tolist() == [5]
    draft = FakeDraft()
    while req is not None:
        req = b.on_expansion(draft(req))
    cycle.sent(b, acc)
    # the target accepted root, node 1, node 2 (a leaf the draft never ran), then emitted 42
    acc2 = Accepted(1, (10, 10, 42), (0, 1, 2))
    b2, req2 = cycle.start(acc2)
    assert req2.keep == (0, 1) and req2.n_given == 1 and req2.tokens.tolist() == [10, 42]
    assert req2.parents.tolist() == [-1, 0]
    while req2 is not None:
        req2 = b2.on_expansion(draft(req2))
    cycle.sent(b2, acc2)
    # the next cycle keeps the given leaf's row (0, text before the root) with the accepted path
    _, req3 = cycle.start(Accepted(2, (10, 7), (0, 1)))
    assert req3.keep == (0, 1, 2) and req3.n_given == 0


def chain_cycle(cycle: TreeCycle, lookahead_rounds: int) -> TreeBuilder:
    """Cycle 1 of a chain of 2 after a 3-token prompt, then some rounds drafted ahead."""
    acc = Accepted(0, (5,), (0, 1, 2))
    b, req = cycle.start(acc)
    draft = FakeDraft()
    while req is not None:
        req = b.on_expansion(draft(req))
    cycle.sent(b, acc)
    for _ in range(lookahead_rounds):
        req = lookahead.request(b)
        if req is None:
            break
        assert req.ahead
        b.absorb(draft(req))
    return b


def test_lookahead_expands_the_leaf_then_the_likeliest_candidates():
    cfg = TreeExpandConfig(policy="chain", chain_length=2, lookahead_nodes=8, round_nodes=4)
    b = chain_cycle(TreeCycle.for_run(cfg, [1, 2, 3]), 1)
    assert b.n_sent == 3 and b.nodes.row == [0, 1, 2]  # the chain's leaf first: every next root hangs below it
    chain_cycle(TreeCycle.for_run(cfg, [1, 2, 3]), 2)
    b = chain_cycle(TreeCycle.for_run(cfg, [1, 2, 3]), 10)
    assert b.ahead.n_ahead == 8 and lookahead.request(b) is None  # the node cap
    ahead = range(b.n_sent, b.n_nodes)
    assert [b.nodes.parents[i] for i in ahead][:4] == [2, 2, 2, 2]  # then the leaf's children, all four
    assert all(b.nodes.gain[i] <= b.nodes.gain[j] for i, j in zip(list(ahead)[4:], list(ahead)[:4]))


def test_lookahead_drafts_only_what_is_likely_enough_to_be_reached():
    def ahead(min_gain: float) -> TreeBuilder:
        cfg = TreeExpandConfig(policy="chain", chain_length=2, lookahead_nodes=8, round_nodes=4,
                               lookahead_min_gain=min_gain)
        return chain_cycle(TreeCycle.for_run(cfg, [1, 2, 3]), 10)

    everything, likely = ahead(0.0), ahead(0.2)
    assert everything.ahead.n_ahead == 8  # by gain alone: the node cap, siblings at 0.05 among them
    assert 0 < likely.ahead.n_ahead < 8  # the leaf (0.49), then its likeliest line while it stays above 0.2
    assert all(likely.nodes.gain[i] >= 0.2 for i in range(likely.n_nodes) if likely.nodes.row[i] >= 0)
    assert ahead(0.5).ahead.n_ahead == 0  # not even the leaf: the sent chain's end is reached at 0.49


def test_lookahead_stays_within_the_idle_time_of_the_pass():
    cfg = TreeExpandConfig(policy="chain", chain_length=2, lookahead_nodes=64)
    busy = TreeCycle.for_run(cfg, [1, 2, 3], cost=FlatCost(read_s=0.0))  # compute-bound: no idle time
    assert chain_cycle(busy, 10).ahead.n_ahead == 0

    def idle() -> TreeCycle:
        return TreeCycle.for_run(cfg, [1, 2, 3], cost=FlatCost(read_s=0.05, draft_step_s=0.02))

    assert chain_cycle(idle(), 10).ahead.n_ahead > 0 and chain_cycle(idle(), 10).ahead.spent_s <= 0.05
    assert lookahead.request(chain_cycle(idle(), 0), time_left_s=0.01) is None  # would outlast the pass


def test_a_right_guess_starts_the_next_tree_from_rows_drafted_ahead():
    cfg = TreeExpandConfig(policy="chain", chain_length=2, lookahead_nodes=8, round_nodes=4)
    cycle = TreeCycle.for_run(cfg, [1, 2, 3])
    b = chain_cycle(cycle, 10)
    # the target took the chain (rows 0, 1, 2) and then 10, whose row the lookahead drafted
    root = next(i for i in range(b.n_sent, b.n_nodes) if b.nodes.parents[i] == 2 and b.nodes.tokens[i] == 10)
    acc = Accepted(1, (10, 10, 10), (0, 1, 2))
    carry = lookahead.carry_for(b, acc)
    assert carry[0] == b.nodes.row[root] and all(r > b.nodes.row[root] for r in carry[1:])
    b2, req = cycle.start(acc)
    assert req.keep == (0, 1, 2) and req.carry == carry and req.n_given == 0
    assert b2.ahead.n_used >= 1 and b2.n_nodes == 3  # the chain's first node came drafted ahead
    assert req.tokens.size < 2  # so at most the second is left to draft
    assert cycle.lookahead_hits == 1


def test_a_wrong_guess_starts_from_scratch():
    cycle = TreeCycle.for_run(TreeExpandConfig(policy="chain", chain_length=2, lookahead_nodes=8), [1, 2, 3])
    chain_cycle(cycle, 10)
    b2, req = cycle.start(Accepted(1, (10, 10, 99), (0, 1, 2)))  # 99 was never drafted
    assert req.carry == () and req.keep == (0, 1, 2) and req.tokens.tolist() == [99]
    assert cycle.lookahead_hits == 0


def test_online_calibration_learns_from_each_cycle():
    """Every proposal at an emitted token is a trial; the next tree's gains use the rates."""
    cycle = TreeCycle.for_run(TreeExpandConfig(policy="gain-cost", max_nodes=8, round_nodes=4), [1, 2, 3])
    acc = Accepted(0, (5,), (0, 1, 2))
    b, req = cycle.start(acc)
    draft = FakeDraft(p_first=0.7)
    while req is not None:
        req = b.on_expansion(draft(req))
    cycle.sent(b, acc)
    first = [i for i in range(1, b.n_nodes) if b.nodes.parents[i] == 0 and b.nodes.rank[i] == 0]
    cycle.start(Accepted(1, (10, 99), (0, first[0])))  # the first child accepted, nothing below
    c = cycle.learner.acceptance
    # at the two emitted tokens, the root's proposals (the first accepted) and first[0]'s (none)
    assert c.trials[0].sum() == 2 and c.accepted[0].sum() == 1
    assert c.trials[1].sum() >= 1 and c.accepted[1].sum() == 0
    assert c(0.1, 1) < 0.1  # rejected later choices now count for less than their draft probability


def test_unknown_policy_is_an_error():
    with pytest.raises(LeverError, match=r"\[tree_expand\] policy"):
        TreeExpandConfig(policy="magic")


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_a_lookahead_min_gain_outside_zero_to_one_names_the_key(value):
    with pytest.raises(LeverError, match=r"\[tree_expand\] lookahead_min_gain"):
        TreeExpandConfig(lookahead_min_gain=value)


def test_measured_slow_reads_grow_the_next_trees_within_a_few_cycles():
    """[tree_expand] adapt: each Accepted's PassTiming corrects the cost model the next tree is priced with."""
    from lever.dataflow.messages import PassTiming
    from lever.policy.acceptance import AcceptanceTable
    from tests.policy.test_cost_model import model

    cm = model(bw=20e9)  # a fast flash: a pass is mostly compute, and nodes cost
    # the cost side alone: an identity prior, so the fake draft's flat rates do not move the gains much
    cycle = TreeCycle.for_run(TreeExpandConfig(policy="gain-cost", max_nodes=64, max_depth=16), [1, 2, 3], cost=cm,
                              acceptance=AcceptanceTable(prior_weight=1.0))
    online = cycle.learner.online
    assert online is not None
    draft, sizes, t = FakeDraft(p_first=0.8), [], 0.0
    acc = Accepted(0, (5,), (0, 1, 2))
    for n in range(1, 8):
        cycle.observe(acc, t)
        b, req = cycle.start(acc)
        while req is not None:
            req = b.on_expansion(draft(req))
        cycle.sent(b, acc)
        sizes.append(b.n_nodes)
        slow = 8 if n >= 3 else 1  # from the third pass on, reads take 8x the profile's
        read_bytes = sum(cm.layer_read_bytes)
        timing = PassTiming(b.n_nodes, cm.compute_s(b.n_nodes), 0.0, slow * read_bytes / cm.read_bytes_per_s,
                            read_bytes, cm.accept_s(2))
        t += 0.5
        # the first child accepted (when the tree has one), then a token never drafted
        acc = Accepted(n, (10, 77), (0, 1), timing=timing) if b.n_nodes > 1 else \
            Accepted(n, (77,), (0,), timing=timing)
    assert online.scales.read == pytest.approx(8, rel=0.1)
    assert max(sizes[:3]) < min(sizes[5:])  # bigger trees within three cycles of the slowdown
    rec = cycle.stats().cycles
    assert len(rec) == 6 and all(r.measured_s == pytest.approx(0.5) and r.tokens == 2 - (r.nodes == 1) for r in rec)
    assert rec[-1].scales.read > rec[0].scales.read and rec[0].nodes == sizes[0]
    assert all(r.predicted_s > 0 and r.predicted_tokens >= 1 for r in rec)


def test_without_adapt_the_profile_prices_every_tree():
    from tests.policy.test_cost_model import model

    learner = TreeCycle.for_run(TreeExpandConfig(policy="gain-cost", adapt=False), [1], cost=model()).learner
    assert learner.online is None and learner.priced_by is learner.cost


def test_no_node_past_the_generations_end():
    """With 3 tokens left, a path of 2 drafted nodes and the bonus token fills them: deeper is waste."""
    cycle = TreeCycle.for_run(TreeExpandConfig(policy="chain", chain_length=8), [1, 2, 3], n_predict=4)
    b, req = cycle.start(Accepted(0, (5,), (0, 1, 2)))  # the prefill emitted one: 3 left
    draft = FakeDraft()
    while req is not None:
        req = b.on_expansion(draft(req))
    assert b.remaining == 3 and max(b.nodes.depth) == 2 and b.n_nodes == 3
    unbounded = TreeCycle.for_run(TreeExpandConfig(policy="chain", chain_length=8), [1, 2, 3])
    b, req = unbounded.start(Accepted(0, (5,), (0, 1, 2)))
    while req is not None:
        req = b.on_expansion(draft(req))
    assert b.n_nodes == 9


def test_a_free_source_learns_from_every_emitted_token_not_only_from_its_nodes():
    """Its table is trained by the text: each emitted token is a trial of what the source would
    have proposed there, whether or not that proposal was in the tree (here none was: the
    tree had no room for it), so a source it had stopped trusting can win its trust back."""
    cfg = TreeExpandConfig(policy="gain-cost", sources=("model", "prompt-lookup"), max_nodes=1)
    cycle = TreeCycle.for_run(cfg, [1, 2, 3, 4, 1, 2, 3])
    table = cycle.learner.lookup_tables["prompt-lookup"]
    assert table.pooled() < 0.2  # a pessimistic guess before any trial
    acc = Accepted(0, (4,), (0, 1, 2, 3, 4, 5, 6))
    b, req = cycle.start(acc)  # lookup said 4: right
    assert b.n_nodes == 1 and table.trials.sum() == 1 and table.accepted.sum() == 1
    cycle.sent(b, acc)
    cycle.start(Accepted(1, (1, 2, 9), (0,)))  # lookup said 1, 2, 3: right, right, wrong
    assert table.trials.sum() == 4 and table.accepted.sum() == 3
    assert table.pooled() > 0.6


def test_free_sources_fill_the_models_tree_and_leave_it_as_the_model_grows_it_alone():
    """The free nodes join after the model's tree is done: its nodes, in order, are the ones
    the model grows alone, and the rate bar the next tree is held to is the model's."""
    from lever.policy.lookup import Lookup

    # below the root 5, the lookup says 20 21 22 9 ...: tokens the draft never proposes
    text = [7, 5, 20, 21, 22, 9, 7, 5]
    alone = TreeBuilder(TreeExpandConfig(policy="gain-cost", max_nodes=64), FlatCost(), cycle=1, room=1000)
    lk = Lookup(("prompt-lookup",))
    lk.extend(text)
    mixed = TreeBuilder(TreeExpandConfig(policy="gain-cost", sources=("model", "prompt-lookup"), max_nodes=64),
                        FlatCost(), cycle=1, room=1000,
                        free=FreeSources(lk, {"prompt-lookup": None}))
    for b in (alone, mixed):
        b.add(5, -1, 1.0)
        draft, req = FakeDraft(), b.request([0], given=[], keep=())
        while req is not None:
            req = b.on_expansion(draft(req))
        b.tree(1, ())
    n = alone.n_nodes
    assert (mixed.n_nodes > n and mixed.nodes.tokens[:n] == alone.nodes.tokens
            and mixed.nodes.parents[:n] == alone.nodes.parents)
    assert set(mixed.nodes.source[n:]) == {"prompt-lookup"} and mixed.nodes.tokens[n : n + 3] == [20, 21, 22]
    assert all(r < 0 for r in mixed.nodes.row[n:])  # no draft forward under them
    learner = TreeLearner.for_run(TreeExpandConfig(policy="gain-cost", sources=("model", "prompt-lookup")),
                                  FlatCost(), text)
    sent = learner.sent(mixed, mixed.tree(1, ()), TREE)
    assert learner.bar_rate == pytest.approx(mixed.free.model_rate)
    assert mixed.free.model_rate < sent.predicted_tokens / sent.predicted_s



def test_greedy_learns_off_policy_from_every_emitted_token_whatever_the_tree():
    """A chain holds no second choice, yet every second choice the draft proposed at an emitted
    token is a trial; a sampled run learns only from the nodes its trees held."""
    for greedy in (True, False):
        cycle = TreeCycle.for_run(TreeExpandConfig(policy="chain", chain_length=2), [1, 2, 3], greedy=greedy)
        b = chain_cycle(cycle, 0)
        assert b.n_nodes == 3 and set(b.nodes.rank) == {0}
        cycle.start(Accepted(1, (10, 11), (0, 1)))  # the first child taken, then the second choice there
        c = cycle.learner.acceptance
        if greedy:  # proposals at the root and at node 1: 1 + 3 trials each
            assert (c.trials[0].sum(), c.accepted[0].sum(), c.trials[1].sum(), c.accepted[1].sum()) == (2, 1, 6, 1)
        else:  # nodes 1 (taken) and 2 (not): the tree's own
            assert (c.trials[0].sum(), c.accepted[0].sum(), c.trials[1].sum()) == (2, 1, 0)


def test_an_accepted_leaf_the_draft_never_ran_is_learned_from_its_given_row():
    cycle = TreeCycle.for_run(TreeExpandConfig(policy="chain", chain_length=2), [1, 2, 3])
    chain_cycle(cycle, 0)
    b2, req2 = cycle.start(Accepted(1, (10, 10, 12), (0, 1, 2)))  # node 2, a leaf, then 12
    assert req2.given_proposals and req2.n_given == 1
    c = cycle.learner.acceptance
    before = c.trials.sum()
    exp = Expansion(2, np.array([1], np.int32), np.array([[10, 11]]), np.array([[0.7, 0.2]], np.float32),
                    given=(np.array([[12, 13]]), np.array([[0.5, 0.3]], np.float32)))
    cycle.expanded(b2, req2, exp, draft_s=0.01)
    assert c.trials.sum() == before + 2 and c.accepted[0, 5] == 1  # 12 was the leaf's first choice, q 0.5


def test_the_drafts_cache_holds_the_whole_accepted_text_cycle_after_cycle(tiny_model):
    """Every chain taken whole: its leaf, never run by the draft, is given to it the next cycle
    and kept the cycle after, so the draft's committed rows are always the text before the root."""
    from lever.model.transformer import Model
    from lever.stages.draft import Drafter

    model = Model(tiny_model("qwen2", "Q8_0", n_layer=1))
    core = Drafter(model, model.new_cache(128))
    prompt = [1, 2, 3]
    cycle = TreeCycle.for_run(TreeExpandConfig(policy="chain", chain_length=2, fallback=False), prompt)
    core.expand(cycle.first_request())
    acc = Accepted(0, (5,), (0, 1, 2))
    for n in range(1, 6):
        b, req = cycle.start(acc)
        first = True
        while req is not None:
            exp = core.expand(req)
            if first:  # the committed text and the given tokens: everything before the root
                assert core.n_committed + req.n_given == len(prompt) + cycle.emitted - 1
                first = False
            req = cycle.expanded(b, req, exp, draft_s=0.01)
        cycle.sent(b, acc)
        acc = Accepted(n, (b.nodes.tokens[1], b.nodes.tokens[2], 9), (0, 1, 2))  # the chain, then 9


@pytest.mark.parametrize("lookahead_nodes, round_nodes, rounds", [(20, 8, 3), (16, 8, 2), (1, 8, 1), (0, 8, 0)])
def test_drafting_ahead_can_use_its_node_cap_in_rounds_of_idle_time(lookahead_nodes, round_nodes, rounds):
    cfg = TreeExpandConfig(lookahead_nodes=lookahead_nodes, round_nodes=round_nodes)
    cost = FlatCost(draft_step_s=0.03)
    cycle = TreeCycle.for_run(cfg, [1, 2, 3], cost=cost)
    b, _ = cycle.start(Accepted(0, (5,), (0, 1, 2)))
    assert b.ahead.usable_s == pytest.approx(rounds * 0.03)
