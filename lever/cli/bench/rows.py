"""The pipelines the benches run, each as overrides of one config file: said once, run by all.

Below every bench (pipelines, cap, flash, sources) and the `lever run` commands they spawn: a
row is a list of `--set` overrides, the config file supplying the models and the rest.
"""

from __future__ import annotations

SPECULATIVE = ('pipeline.kind="speculative"',)
FLASH_AR = ('pipeline.kind="flash-ar"',)  # the paper's baseline: the target streamed, no draft
NO_BASELINE = ('pipeline.baseline=""',)  # a row alone, without its [pipeline] baseline after it
LEVER = (*SPECULATIVE, 'tree_expand.policy="gain-cost"')
# EdgeLLM-like: a confidence bar without a latency model; the baselines draft nothing ahead
CONFIDENCE = (*SPECULATIVE, 'tree_expand.policy="confidence"', "tree_expand.lookahead_nodes=0")
# Lever with no layer pinned, every layer read through the page cache, which keeps what a cap
# leaves: the kernel's LRU as the block cache, against the plan's static residency
LEVER_LRU = (*SPECULATIVE, 'flash.mode="cached"', "flash.dram_budget=0")


def chain(k: int) -> tuple[str, ...]:
    """Chain-SD: a chain of k draft tokens a cycle."""
    return (*SPECULATIVE, 'tree_expand.policy="chain"', f"tree_expand.chain_length={k}",
            "tree_expand.lookahead_nodes=0")


def pipelines(chain_ks, pruning: bool = False) -> dict[str, list[str]]:
    """The side-by-side rows: Flash-AR, Chain-SD at each k, EdgeLLM-like, Lever; with pruning,
    Lever again with its predictor (from `lever calibrate`)."""
    runs = {"flash-ar": list(FLASH_AR)}
    for k in chain_ks:
        runs[f"chain-sd k={k}"] = list(chain(k))
    runs["edgellm-like"] = list(CONFIDENCE)
    runs["lever"] = list(LEVER)
    if pruning:
        runs["lever+pruning"] = [*runs["lever"], "predictor.enabled=true"]
    return runs
