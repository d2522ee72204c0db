"""The messages that move between stages, all in one module.

One decoding cycle is a loop of three nouns: TreeExpand sends a `TokenTree` (what the target
should verify this pass), PrunedVerify turns it into `Verified` hidden states, Accept answers
with `Accepted` (the tokens that came out and which tree rows the caches keep). To grow a tree,
TreeExpand and Draft trade `ExpandRequest`s and `Expansion`s. Beside the loop,
Prefetch streams `StreamedLayer`s (a layer's weights, read from flash into a window buffer) to
PrunedVerify, which hands each buffer back as a `FreeBuffer` once the layer is computed.
Ownership follows the messages: the target's KV cache belongs to PrunedVerify and changes only
by the `keep` a TokenTree carries, so no two stages share mutable state.
"""

from __future__ import annotations

import attrs
import numpy as np

from lever.backends.cpu.layer import LayerWeights
from lever.model.stop import StopReason


@attrs.frozen
class Proposals:
    """The draft's children of one node: its tokens in the order drawn (most probable first
    when chosen by rank; -1 pads where fewer tokens had mass than were asked for), the draft's
    probability of each, and, when the run samples, the distribution they were drawn from,
    which the target's rejection sampling needs (Accept)."""

    tokens: np.ndarray = attrs.field(eq=False)  # (k,) int64
    probs: np.ndarray = attrs.field(eq=False)  # (k,) float32
    q: np.ndarray | None = attrs.field(default=None, eq=False)  # (n_vocab,) float32; None: chosen by rank

    def drawn(self) -> Proposals:
        """Without the padding."""
        real = self.tokens >= 0
        return Proposals(self.tokens[real], np.asarray(self.probs)[real], self.q)


@attrs.frozen
class TokenTree:
    """The nodes one verification pass runs, hanging off the committed prefix.

    Node 0 is the root: the newest accepted token, whose KV row does not exist yet. Nodes
    0..n_given-1 form a chain of tokens already decided (the prompt at prefill, else the root
    alone); the rest are the draft's guesses. parents[i] < i, and parents[0] = -1.
    """

    pass_id: int
    tokens: np.ndarray = attrs.field(eq=False)  # (n_nodes,) int64
    parents: np.ndarray = attrs.field(eq=False)  # (n_nodes,) int32
    n_given: int = 1
    # (n_nodes,) float32, each node's estimated acceptance: the chance the target's walk reaches it
    gains: np.ndarray | None = attrs.field(default=None, eq=False)
    # (n_nodes,) float32, each node's probability under its proposer (the draft's, given its parent)
    q: np.ndarray | None = attrs.field(default=None, eq=False)
    keep: tuple[int, ...] | None = None  # rows of the previous pass to keep; None keeps all
    # node -> the draft's children there: what speculative sampling needs at each expanded node,
    # and the pruning predictor's shadow candidates. Only some of them may be nodes of the tree.
    drafts: dict[int, Proposals] = attrs.field(factory=dict, eq=False)
    cycle_s: float = 0.0  # TreeExpand's estimate of this cycle's latency (drafting and the pass); 0: none

    @property
    def n_nodes(self) -> int:
        return int(self.tokens.size)

    def depths(self) -> np.ndarray:
        d = np.zeros(self.n_nodes, np.int32)
        for i in range(1, self.n_nodes):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """(n_nodes, n_nodes) bool: node i sees node j when j is i or an ancestor of i."""
        m = np.eye(self.n_nodes, dtype=bool)
        for i in range(1, self.n_nodes):
            m[i] |= m[self.parents[i]]
        return m

    @staticmethod
    def chain(pass_id: int, tokens, n_given: int | None = None, keep=None) -> TokenTree:
        t = np.asarray(tokens, np.int64)
        return TokenTree(pass_id, t, np.arange(-1, t.size - 1, dtype=np.int32),
                         t.size if n_given is None else n_given, keep=keep)


def children_of(tree: TokenTree) -> list[list[int]]:
    """Each node's children, in node order (parents come before children)."""
    kids: list[list[int]] = [[] for _ in range(tree.n_nodes)]
    for i in range(1, tree.n_nodes):
        kids[int(tree.parents[i])].append(i)
    return kids


def likely_path(tree: TokenTree, kids: list[list[int]], node: int, n: int | None = None) -> list[int]:
    """`node`, then its child of the highest gain (the first without gains), and so on down: at
    most n nodes (None: to a leaf)."""
    path, gains = [node], tree.gains
    while (n is None or len(path) < n) and kids[node]:
        node = max(kids[node], key=lambda c: gains[c]) if gains is not None else kids[node][0]
        path.append(node)
    return path


@attrs.frozen
class PassTiming:
    """What one cycle's verification measured, for the cost model's online estimates
    (lever.policy.online): the pass's compute and reads, and Accept's time after it."""

    n_tokens: int  # nodes the pass ran
    compute_s: float  # wall time of the pass's layer computations
    wait_s: float  # time the pass waited for a streamed layer to land
    read_s: float  # wall time of the reads of the pass's streamed layers, one after another
    read_bytes: int  # bytes those reads moved
    accept_s: float = 0.0  # Accept's output head and walk along the accepted path
    slot_wait_s: float = 0.0  # time a landed layer waited for the cores (a draft-ahead forward held them)


@attrs.frozen
class Verified:
    """The target's last-layer hidden states for every node of a tree (before the final norm)."""

    tree: TokenTree
    hidden: np.ndarray = attrs.field(eq=False)  # (n_nodes, n_embd)
    # (n_nodes,) bool: nodes verified to the last layer; pruned ones hold a middle layer's state
    # and must not be descended into. None: all of them.
    alive: np.ndarray | None = attrs.field(default=None, eq=False)
    timing: PassTiming | None = None  # what the pass measured


@attrs.frozen
class TokenLogprob:
    """The target's log-probability of one emitted token, and of its likeliest alternatives:
    from the raw logits at that position (before temperature, penalties or cuts), as OpenAI's
    `logprobs` report them; never the draft's."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), likeliest first


@attrs.frozen
class Accepted:
    """What one cycle produced."""

    pass_id: int
    tokens: tuple[int, ...]  # newly emitted tokens, in order (the last is the next root)
    keep: tuple[int, ...]  # tree nodes whose KV rows stay (the accepted path, given chain first)
    done: bool = False
    stop_reason: StopReason | None = None  # why, when done
    pruned: tuple[int, ...] = ()  # tree nodes the predictor pruned: whether the target took them is unknown
    timing: PassTiming | None = None  # the pass's and Accept's measured times
    drafted_kept: int = 0  # of `tokens`, those that were tree nodes (accepted drafts, not the target's own)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the generation asked for them
    tree: TokenTree | None = attrs.field(default=None, eq=False)  # the tree this pass verified (a watcher draws it)


@attrs.frozen
class ExpandRequest:
    """TreeExpand asks Draft to run some tree nodes through the draft model.

    The nodes are appended to the draft's pending rows of this cycle, in order; parents index
    those pending rows (-1: the node follows the committed prefix directly). The first request
    of a cycle carries `keep`, the previous cycle's pending rows to keep (the accepted path),
    and may start with tokens already accepted that the draft has not seen (`n_given`); the
    other requests of a cycle carry None. It may also carry rows drafted ahead while the target
    verified (`carry`: the new root and its subtree), which stay pending, renumbered from 0 in
    order; such a request may have no tokens at all.
    """

    cycle: int
    tokens: np.ndarray = attrs.field(eq=False)  # (n,) int64
    parents: np.ndarray = attrs.field(eq=False)  # (n,) int32, into this cycle's pending rows
    top_k: int = 4  # children to return for each node that is not given
    n_given: int = 0  # leading nodes that only extend the cache (no children returned)
    keep: tuple[int, ...] | None = None
    carry: tuple[int, ...] = ()  # previous pending rows (ascending) that stay pending, after `keep`
    ahead: bool = False  # drafted ahead while the target verifies: runs only when verification waits
    # return the given nodes' most probable next tokens too (`Expansion.given`): greedy runs
    # learn acceptance from every emitted token, and a given node is an accepted leaf the draft
    # never ran, the position before the newest token. Its rows ride in the same head matmul.
    given_proposals: bool = False


@attrs.frozen
class Expansion:
    """The draft's proposals for each expanded node: its most probable next tokens, or, when
    the run samples, tokens drawn without replacement from the draft's distribution (which
    comes along, for the target's rejection sampling)."""

    cycle: int
    rows: np.ndarray = attrs.field(eq=False)  # (m,) pending-row index of each expanded node
    # (m, top_k) int64, most probable first (or in draw order); -1 pads
    child_tokens: np.ndarray = attrs.field(eq=False)
    child_probs: np.ndarray = attrs.field(eq=False)  # (m, top_k) float32, draft probabilities
    child_q: np.ndarray | None = attrs.field(default=None, eq=False)  # (m, n_vocab) float32 drawn from, when sampling
    # (n_given, top_k) tokens and probabilities at the given nodes, when the request asked
    given: tuple[np.ndarray, np.ndarray] | None = attrs.field(default=None, eq=False)

    def proposals(self, i: int) -> Proposals:
        """The children of the i-th expanded node."""
        return Proposals(self.child_tokens[i], self.child_probs[i], None if self.child_q is None else self.child_q[i])


@attrs.frozen
class LayerMessage:
    """What Prefetch sends PrunedVerify: a pass's plan, then that pass's streamed layers."""

    pass_id: int


@attrs.frozen
class PassLayers(LayerMessage):
    """The layers one pass streams, fixed when Prefetch begins it. The resident set can change
    while a run goes (a live memory budget: lever.pipelines.residency), so each pass carries its
    own: PrunedVerify takes these from the channel and every other layer from the residency."""

    streamed: tuple[int, ...]


@attrs.frozen
class StreamedLayer(LayerMessage):
    """One layer's weights, read from flash into a window buffer for one pass."""

    layer: int
    weights: LayerWeights
    buffer_id: int  # which window buffer holds the bytes (returned as a FreeBuffer)
    n_bytes: int
    read_s: float = 0.0  # wall time of its read


@attrs.frozen
class FreeBuffer:
    """A window buffer handed back to Prefetch after its layer was computed."""

    buffer_id: int
