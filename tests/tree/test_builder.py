"""TreeBuilder grown by every policy from a fake draft (no event loop, no model)."""

from __future__ import annotations

import numpy as np

from lever.policy.acceptance import AcceptanceTable
from lever.policy.cost import ALONE, FlatCost, Others
from lever.tree.builder import TreeBuilder
from lever.tree.config import TreeExpandConfig
from lever.tree.free import FreeSources
from lever.tree.lookahead import Lookahead
from tests.tree.fake_draft import FakeDraft


def grow(config: TreeExpandConfig, cost=FlatCost(), room=1000, acceptance=None, p_first=0.7,
         others: Others = ALONE) -> TreeBuilder:
    b = TreeBuilder(config, cost, cycle=1, room=room, acceptance=acceptance, others=others)
    b.add(5, -1, 1.0)
    draft = FakeDraft(p_first)
    req = b.request([0], given=[], keep=())
    while req is not None:
        req = b.on_expansion(draft(req))
    return b


def test_chain_is_a_chain_of_k():
    b = grow(TreeExpandConfig(policy="chain", chain_length=4))
    assert b.n_nodes == 5 and b.nodes.parents == [-1, 0, 1, 2, 3] and b.nodes.tokens[1:] == [10] * 4


def test_kary_is_full():
    b = grow(TreeExpandConfig(policy="kary", top_k=2, kary_depth=3, max_nodes=100))
    assert b.n_nodes == 1 + 2 + 4 + 8 and max(b.nodes.depth) == 3


def test_gain_cost_grows_when_reads_dominate_and_shrinks_when_compute_does():
    cfg = TreeExpandConfig(policy="gain-cost", max_nodes=64)
    slow_flash = grow(cfg, FlatCost(read_s=2.0, compute_per_token_s=0.005, draft_step_s=0.02))
    fast_flash = grow(cfg, FlatCost(read_s=0.01, compute_per_token_s=0.005, draft_step_s=0.02))
    assert slow_flash.n_nodes > 2 * fast_flash.n_nodes
    assert fast_flash.n_nodes >= 2  # the first, likely child is still worth it


def test_a_runs_first_tree_goes_as_deep_as_the_drafts_first_choices_are_sure():
    """Before the table has seen a first child, a level's reach is priced at the prior of the
    first choices the draft proposed in this tree, not at a flat half (which stopped 3 deep)."""
    cfg = TreeExpandConfig(policy="gain-cost", max_nodes=64, max_depth=24)
    cost = FlatCost(read_s=0.1, compute_per_token_s=0.002, draft_step_s=0.02)
    sure = grow(cfg, cost, acceptance=AcceptanceTable(prior_weight=1.0, shaped=True), p_first=0.95)
    unsure = grow(cfg, cost, acceptance=AcceptanceTable(prior_weight=1.0, shaped=True), p_first=0.5)
    assert max(sure.nodes.depth) >= 10 > 3 >= max(unsure.nodes.depth)  # a flat half: 3 deep for both


def test_an_expensive_pass_with_cheap_nodes_grows_hundreds_of_nodes():
    """Where the pass reads for seconds and a node's compute is nearly free (an NPU beside
    slow flash), the same policy grows trees of hundreds of nodes, as SpecExec and Sequoia do."""
    cfg = TreeExpandConfig(policy="gain-cost", max_nodes=1024, max_depth=64)
    phone = grow(cfg, FlatCost(read_s=4.0, compute_per_token_s=0.002, draft_step_s=0.02),
                 acceptance=AcceptanceTable(prior_weight=1.0, shaped=True), p_first=0.9)
    dram = grow(cfg, FlatCost(read_s=0.05, compute_per_token_s=0.002, draft_step_s=0.02),
                acceptance=AcceptanceTable(prior_weight=1.0, shaped=True), p_first=0.9)
    assert phone.n_nodes > 300 and max(phone.nodes.depth) > 40
    assert dram.n_nodes < 40


def test_gain_is_the_path_probability():
    b = grow(TreeExpandConfig(policy="chain", chain_length=3))
    assert np.allclose(b.nodes.gain, [1.0, 0.7, 0.49, 0.343])


def test_caps_and_room_bound_every_policy():
    for policy in ("kary", "gain-cost", "confidence"):
        b = grow(TreeExpandConfig(policy=policy, max_nodes=10, kary_depth=5, confidence=0.0),
                 FlatCost(read_s=100.0))
        assert b.n_nodes <= 10
    assert grow(TreeExpandConfig(policy="kary", kary_depth=5, max_nodes=100), room=7).n_nodes == 7


def test_draft_rows_and_parents_follow_expansion_order():
    b = grow(TreeExpandConfig(policy="chain", chain_length=2))
    assert b.nodes.row == [0, 1, -1]  # root and the first node expanded in turn; the full chain's leaf never
    tree = b.tree(pass_id=3, keep=(0,))
    assert tree.n_given == 1 and tree.parents.tolist() == [-1, 0, 1] and tree.keep == (0,)


def grow_with(lookup_text: list[int]) -> TreeBuilder:
    from lever.policy.lookup import Lookup

    lk = Lookup(("prompt-lookup",))
    lk.extend(lookup_text)
    b = TreeBuilder(TreeExpandConfig(policy="gain-cost", sources=("model", "prompt-lookup"), max_nodes=64),
                    FlatCost(), cycle=1, room=1000, free=FreeSources(lk))
    b.add(lookup_text[-1], -1, 1.0)
    draft, req = FakeDraft(), None
    req = b.request([0], given=[], keep=())
    while req is not None:
        req = b.on_expansion(draft(req))
    b.tree(1, ())
    return b


def test_a_free_source_continues_its_own_text_not_the_drafts_guesses():
    # "5 10" came before, followed by 30: below the draft's 10 prompt lookup would say 30, but
    # that 10 is the draft's guess, not text the lookup predicted, so it proposes nothing there
    b = grow_with([5, 10, 30, 31, 7, 5])
    assert 10 in b.nodes.tokens and 30 not in b.nodes.tokens
    # here the lookup predicts the 10 itself ("7 5" -> 10), so the node is both sources', and
    # the lookup goes on below it: 30, then 31
    b = grow_with([7, 5, 10, 30, 31, 9, 7, 5])
    ten = b.nodes.tokens.index(10)
    assert (b.nodes.parents[ten] == 0
            and "prompt-lookup" in [b.nodes.source[ten], *(x[0] for x in b.nodes.also.get(ten, ()))])
    thirty = b.nodes.tokens.index(30)
    assert b.nodes.parents[thirty] == ten and b.nodes.parents[b.nodes.tokens.index(31)] == thirty


def test_a_forward_reads_the_free_chain_below_the_node_it_expands():
    """Where prompt lookup knows what follows, one forward runs its chain (not one forward a
    token); chain nodes the draft's own children confirm get the model's gain, the rest none."""
    from lever.policy.acceptance import AcceptanceTable
    from lever.policy.lookup import Lookup

    lk = Lookup(("prompt-lookup",))
    lk.extend([7, 5, 10, 10, 10, 10, 9, 7, 5])  # after "7 5": 10 10 10 10 9; the draft proposes 10-13 everywhere
    b = TreeBuilder(TreeExpandConfig(policy="gain-cost", sources=("model", "prompt-lookup"), max_nodes=64),
                    FlatCost(), cycle=1, room=1000,
                    free=FreeSources(lk, {"prompt-lookup": AcceptanceTable(pooled_prior=0.9)}))
    b.add(5, -1, 1.0)
    draft, req, sizes = FakeDraft(), b.request([0], given=[], keep=()), []
    while req is not None:
        sizes.append(req.tokens.size)
        req = b.on_expansion(draft(req))
    assert sizes[1] >= 5  # the model's 10, then the chain 10 10 10 9 below it, in one forward
    chain = [n for n in range(b.n_nodes) if b.nodes.source[n] == "prompt-lookup"]
    priced = [n for n in chain if b.nodes.gain[n] > 0]
    assert [b.nodes.tokens[n] for n in priced] == [10, 10, 10] and all(b.nodes.gain[n] > 0.1 for n in priced)
    assert all(any(x[0] == "model" for x in b.nodes.also[n]) for n in priced)  # the draft's own children, merged
    nine = chain[3]
    assert (b.nodes.tokens[nine] == 9 and b.nodes.row[nine] >= 0
            and "model" not in [x[0] for x in b.nodes.also.get(nine, ())])
    assert all(b.nodes.gain[n] == 0.0 for n in chain[3:])  # run by the draft, not confirmed: no gain below


def test_idle_time_past_what_drafting_ahead_can_spend_makes_no_node_dearer():
    """A node's compute takes idle time from drafting ahead only once the pass leaves less
    than drafting ahead can spend: before that, it costs what it adds to the cycle, nothing more."""
    cost = FlatCost(read_s=3.0, compute_per_token_s=0.05, draft_step_s=0.02)  # idle until 60 nodes
    for usable_s in (0.1, 0.5, 1.0, float("inf")):
        b = TreeBuilder(TreeExpandConfig(), cost, cycle=1, room=1000,
                        ahead=Lookahead(idle_value=0.5, usable_s=usable_s))
        b.add(5, -1, 1.0)
        for n in range(1, 70):
            extra = b.price_s(n + 1) - b.price_s(n)
            latency = b.latency_s(n + 1) - b.latency_s(n)
            if cost.idle_s(n + 1) >= usable_s:  # drafting ahead has all it can use either way
                assert extra == latency
            else:  # the node's compute comes out of drafting ahead's time, at its value
                assert extra >= latency
        if usable_s < 3.0:
            assert b.price_s(10) - b.price_s(5) == b.latency_s(10) - b.latency_s(5)
