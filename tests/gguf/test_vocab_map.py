"""Draft and target with different token tables: the shipped draft rewritten with
its ids permuted (the same function: token table and embedding rows moved together) and with padding
rows appended, drafting through lever.gguf.vocab_map. Greedy output stays the target's own (Flash-AR
and the DRAM loop); acceptance stays the original pair's; sampling stays exact."""

from __future__ import annotations

import io

import numpy as np
import pytest

from lever.cli.run import print_summary
from lever.config import load_config
from lever.errors import LeverError
from lever.fuzz.inputs import ARR, I32, STR, parse_seed, serialize, tensor_bytes
from lever.gguf.file import GGUFFile
from lever.gguf.tokenizer import UNUSED, Tokenizer
from lever.gguf.vocab_map import pair_vocabularies
from lever.model.generate import GREEDY, generate
from lever.model.sampling import SamplingParams
from lever.model.transformer import Model
from lever.pipelines.engine import run_pipeline
from lever.shipped import shipped
from lever.stages.draft import Drafter
from lever.tree.config import TreeExpandConfig
from tests.conftest import QWEN_DRAFT, QWEN_TARGET
from tests.stages import test_accept as exact

TARGET, DRAFT = shipped("models", "stdlib-target-q4_0.gguf"), shipped("models", "stdlib-draft-q8_0.gguf")
PROMPT = "def read_config(path):\n    \"\"\"Read a config file and return a dict.\"\"\"\n"
N_PAD = 40


def rewrite(src, dst, *, perm: np.ndarray | None = None, pad_rows: list[int] = ()) -> None:
    """src with token id j holding what id perm[j] held (token string, type, embedding and output
    rows, the special ids following), then padding tokens appended whose embedding rows copy
    pad_rows' with their scales doubled (Q8_0: unmasked, they would outscore those tokens)."""
    data = src.read_bytes()
    seed, d = parse_seed(src.name, data)
    align = d.find("general.alignment")
    start = -(-seed.header_end // (align.value if align else 32)) * (align.value if align else 32)
    tokens = d.find("tokenizer.ggml.tokens")
    n = len(tokens.value)
    perm = np.arange(n) if perm is None else perm
    inverse = np.argsort(perm)
    for t in d.tensors:
        size = tensor_bytes(t.ggml_type, t.dims)
        t.content, t.offset = data[start + t.offset : start + t.offset + size], None
        if t.name in ("token_embd.weight", "output.weight"):
            rows = np.frombuffer(t.content, np.uint8).reshape(n, -1)[perm]
            assert t.ggml_type == 8 or not pad_rows  # Q8_0: 34-byte blocks, an f16 scale first
            pads = rows[inverse[list(pad_rows)]].copy()
            if pad_rows:
                blocks = pads.reshape(len(pad_rows), -1, 34)
                blocks[:, :, :2] = (blocks[:, :, :2].copy().view(np.float16) * 2).view(np.uint8)
            t.content = np.concatenate([rows, pads]).tobytes()
            t.dims = [t.dims[0], n + len(pad_rows)]
    tokens.value = [tokens.value[i] for i in perm] + [f"[PAD{n + i}]" for i in range(len(pad_rows))]
    types = d.find("tokenizer.ggml.token_type")
    types.value = [types.value[i] for i in perm] + [UNUSED] * len(pad_rows)
    for kv in d.kvs:
        if kv.key.endswith("_token_id"):
            kv.value = int(inverse[kv.value])
    d.find(f"{d.arch}.vocab_size").value = n + len(pad_rows)
    assert tokens.vtype == ARR and tokens.elem == STR and types.elem == I32
    serialize(d).write(dst)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """The target's own greedy completion, by the DRAM loop."""
    tok = Tokenizer.from_gguf(TARGET)
    return generate(Model(TARGET), tok.encode(PROMPT), 48, GREEDY, eos_ids=frozenset(tok.eos_ids)).tokens


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, reference) -> dict:
    tmp = tmp_path_factory.mktemp("vocab")
    perm = np.random.default_rng(19).permutation(4096)
    out = {"original": DRAFT, "permuted": tmp / "permuted.gguf", "padded": tmp / "padded.gguf",
           "both": tmp / "both.gguf"}
    rewrite(DRAFT, out["permuted"], perm=perm)
    # the tokens the draft must propose first (unmasked, their pads would outscore them), then others
    pads = list(dict.fromkeys([*reference, *range(1, 4096)]))[:N_PAD]
    rewrite(DRAFT, out["padded"], pad_rows=pads)
    rewrite(DRAFT, out["both"], perm=perm, pad_rows=pads)
    return out


def test_the_map_is_the_permutation_and_skips_the_padding(drafts):
    perm = np.random.default_rng(19).permutation(4096)
    vmap, warnings = pair_vocabularies(GGUFFile(TARGET), GGUFFile(drafts["both"]))
    assert warnings == []
    assert vmap.to_target[:4096].tolist() == perm.tolist()  # draft id j is the target's perm[j]
    assert (vmap.to_target[4096:] == -1).all() and vmap.unmapped.tolist() == list(range(4096, 4096 + N_PAD))
    assert (vmap.to_target[vmap.to_draft] == np.arange(4096)).all()  # every target token fed as itself
    f = vmap.figures
    assert (f.draft_tokens, f.draft_mapped, f.target_tokens, f.target_reachable, f.stand_ins) == (4136, 4096, 4096,
                                                                                                   4096, 0)
    # the same table: no map at all, the drafting path untouched
    assert pair_vocabularies(GGUFFile(TARGET), GGUFFile(DRAFT)) == (None, [])


def test_a_padded_target_feeds_its_padding_as_a_stand_in(drafts):
    """The other way round (a draft of 4,096 tokens for a target of 4,136): every draft token
    maps; the target's padding, which the draft cannot produce, is never drafted, and is fed to
    the draft as the longest start of its text the draft has, "[" here."""
    vmap, _ = pair_vocabularies(GGUFFile(drafts["padded"]), GGUFFile(DRAFT))
    f = vmap.figures
    assert (f.draft_mapped, f.target_tokens, f.target_reachable, f.stand_ins) == (4096, 4136, 4096, N_PAD)
    bracket = Tokenizer.from_gguf(DRAFT).encode("[", add_bos=False)
    assert vmap.to_draft[4096:].tolist() == bracket * N_PAD and vmap.unmapped.size == 0


def _run(draft, *sets):
    cfg = load_config(shipped("default.toml"), [f'model.draft="{draft}"', "generate.n_predict=48",
                                                'pipeline.baseline="flash-ar"', "tree_expand.adapt=false", *sets])
    return run_pipeline(cfg, PROMPT)


def test_greedy_output_and_acceptance_are_the_original_pairs(drafts, reference):
    """Lossless against Flash-AR and the DRAM loop; with the adaptive cost corrections off (trees
    that follow timing), the trees are the same too: the permuted draft computes the same function,
    and the padding rows, which would outscore the tokens they copy, are masked."""
    runs = {name: _run(path) for name, path in drafts.items()}
    for name, res in runs.items():
        assert res.tokens == reference == res.baseline.tokens, name
    per_pass = {name: res.output.tokens_per_pass for name, res in runs.items()}
    assert per_pass["original"] > 1.5, per_pass
    assert len(set(per_pass.values())) == 1, per_pass
    assert runs["original"].vocab is None
    f = runs["both"].vocab
    assert (f.draft_mapped, f.draft_tokens, f.target_reachable, f.target_tokens) == (4096, 4136, 4096, 4096)
    assert runs["both"].as_json()["vocab"]["draft_mapped"] == 4096
    buf = io.StringIO()
    print_summary(runs["both"], buf)
    assert ("  vocabulary  draft -> target: 4,096 of 4,136 draft tokens map (99.0%); 4,096 of 4,096 target tokens "
            "reachable (100%); mapped in ") in buf.getvalue()
    buf = io.StringIO()
    print_summary(runs["original"], buf)
    assert "vocabulary" not in buf.getvalue()


def test_unmasked_padding_would_be_proposed(drafts, reference):
    """Control: the padded draft's own top-1 is a padding row at most of the completion's steps,
    so the acceptance above holds because they are masked, not because they never win."""
    model = Model(drafts["padded"])
    tok = Tokenizer.from_gguf(TARGET)
    ids = tok.encode(PROMPT) + reference
    h = model.forward(np.asarray(ids), np.arange(len(ids), dtype=np.int32),
                      np.tril(np.ones((len(ids), len(ids)), bool)), model.new_cache(len(ids)))
    top = model.logits(h[-len(reference):]).argmax(axis=1)
    assert (top >= 4096).mean() > 0.5


def test_sampled_runs_with_a_mapped_draft_are_seeded(drafts):
    a, b = (_run(drafts["both"], "generate.temperature=0.8", "generate.seed=5") for _ in range(2))
    assert a.tokens == b.tokens and len(a.tokens) == 48 and a.output.tokens_per_pass > 1.2


# -- sampling stays exact: the draft's q, restricted to what maps, over the target's ids

DRAFT_V = 6  # the synthetic draft: two tokens with no target counterpart, target token 3 unreachable
TO_TARGET = np.array([2, -1, 0, 1, -1, -1])


class MappedSamplingDraft(exact.SamplingDraft):
    """The synthetic draft of tests/stages/test_accept.py, over a vocabulary of its own, drawing
    through Drafter.draw with a map, as Draft does when sampling with a mapped pair."""

    def __init__(self, prefix, rng, drafter):
        super().__init__(prefix, rng)
        self.drafter = drafter

    def __call__(self, req):
        rows = self.rows(req)
        # a draft distribution over its own ids (salt 3), most of its mass on the ids that map
        logits = np.log(np.stack([np.random.default_rng([3, *self.paths[r]]).dirichlet(np.full(DRAFT_V, 0.6))
                                  for r in rows]))
        toks, probs, q = self.drafter.draw(logits, req.top_k)
        return exact.Expansion(req.cycle, rows, toks, probs, q)


def _mapped_drafter(rng) -> Drafter:
    from lever.gguf.vocab_map import VocabFigures, VocabMap

    to_draft = np.array([2, 3, 0, 1])  # target 3 has no counterpart: fed as draft 1 (a stand-in)
    mapped = np.flatnonzero(TO_TARGET >= 0)
    vmap = VocabMap(TO_TARGET, to_draft, np.flatnonzero(TO_TARGET < 0), mapped, TO_TARGET[mapped],
                    VocabFigures(DRAFT_V, 3, exact.V, 3, 1, 0.0))
    return Drafter(None, None, sampling=SamplingParams(temperature=1.0), rng=rng, vocab=vmap)


def _speculative_samples(monkeypatch, seed: int) -> list:
    rng = np.random.default_rng(seed)
    drafter = _mapped_drafter(rng)
    monkeypatch.setattr(exact, "SamplingDraft", lambda prefix, r: MappedSamplingDraft(prefix, r, drafter))
    config = TreeExpandConfig(policy="gain-cost", max_nodes=8, max_depth=3, top_k=3, round_nodes=4)
    return [exact.speculative_sample(rng, config) for _ in range(exact.TRIALS)]


def test_mapped_speculative_sampling_matches_the_targets_distribution(monkeypatch):
    samples = _speculative_samples(monkeypatch, 1)
    stat, limit = exact.chi_square_vs_target(samples)
    assert stat < limit, f"chi-square {stat:.1f} over the {limit:.1f} an exact sampler stays under"


def test_the_mapped_distribution_test_catches_an_unmapped_q(monkeypatch):
    """Control: q left over the draft's ids (the draws mapped, their distribution not) is biased."""
    real = Drafter.draw

    def unscattered(self, logits, k):
        toks, probs, _ = real(self, logits, k)
        q = np.exp(logits)[:, : exact.V]
        return toks, probs, (q / q.sum(axis=1, keepdims=True)).astype(np.float32)

    monkeypatch.setattr(Drafter, "draw", unscattered)
    stat, limit = exact.chi_square_vs_target(_speculative_samples(monkeypatch, 1))
    assert stat > limit


# -- what stays refused, and the cost on a real vocabulary


def test_another_tokenizer_is_refused_in_one_line(tmp_path):
    from tests.gguf.test_vocab_check import _draft_with

    draft = _draft_with(tmp_path, "tokenizer.ggml.merges", lambda m: [m[1], m[0], *m[2:]])
    with pytest.raises(LeverError) as e:
        pair_vocabularies(GGUFFile(TARGET), GGUFFile(draft))
    msg = str(e.value)
    assert f"draft {draft} and target {TARGET}: merges differ (2 of 3,839): " in msg and "\n" not in msg


def test_mapping_qwen_with_every_id_moved(tmp_path):
    """A Qwen2.5-Coder table of 151,936 tokens with every id moved (rotated by one), the worst
    case for the map (a dict of every string and as many lookups: about 90-170 ms on the shared
    2-core box, a figure, not a test)."""
    if not (QWEN_TARGET.exists() and QWEN_DRAFT.exists()):
        pytest.skip("the Qwen2.5-Coder pair is not fetched")
    from tests.gguf.test_vocab_check import _with_strings

    path = tmp_path / "rotated.gguf"
    _with_strings(QWEN_DRAFT, path, "tokenizer.ggml.tokens", lambda toks: toks[1:] + toks[:1])
    t, d = GGUFFile(QWEN_TARGET), GGUFFile(path)
    vmap, _ = pair_vocabularies(t, d)
    f = vmap.figures
    assert (f.draft_mapped, f.target_reachable) == (151_936, 151_936)
    assert vmap.to_target[:5].tolist() == [1, 2, 3, 4, 5] and vmap.to_target[-1] == 0
