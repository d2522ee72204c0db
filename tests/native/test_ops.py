"""native rmsnorm / rope / attention / swiglu against lever.model.reference.ops, on every ISA this
CPU runs, plus the batch-invariance contract of native/lever_kernels.h (bit-exact checks).

Inputs are standard normal unless said otherwise, so outputs are O(1) and absolute
tolerances are meaningful.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from lever.backends.cpu import native
from lever.errors import LeverError
from lever.model.reference import ops as ref

# Tolerances against the float64 reference. Scalar C attention accumulates in double;
# SIMD paths reorder sums and use their own exp (a few ulp), hence the looser bounds.
RMSNORM_RTOL = 2e-6  # same scale arithmetic on every ISA, only the sum order differs
ROPE_ATOL = 2e-6  # one rope path for all ISAs: cosf/sinf (~1 ulp) and two products
SWIGLU_RTOL_SCALAR = 1e-6
SWIGLU_RTOL_SIMD = 2e-6
SWIGLU_ATOL = 1e-30  # the SIMD exp flushes e^x below ~1e-38 to zero
ATTN_ATOL_SCALAR = 5e-7  # double inside: within an ulp of the float64 reference
ATTN_ATOL_SIMD = 1e-5
ATTN_ATOL_LONG = 5e-5  # n_kv = 32768: float sums of 32k terms, ~sqrt(n) * eps; seen up to 1.2e-5

ISAS = [isa for isa in ("scalar", "avx2", "avx512", "neon") if native.set_isa(isa) == isa]
native.set_isa(native.best_isa())


@pytest.fixture(params=ISAS)
def isa(request):
    native.set_isa(request.param)
    yield request.param
    native.set_isa(native.best_isa())


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by the test's key (stable across runs, unlike hash())."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def normal(rng, shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def inv_freq(n_rot: int, base: float = 10000.0) -> np.ndarray:
    return (1.0 / base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)).astype(np.float32)


def tree_mask(parents: list[int], n_prefix: int, n_extra: int = 0) -> np.ndarray:
    """(n_tok, n_prefix + n_tok + n_extra): every token sees the prefix, its ancestors and
    itself (token rows follow the prefix); the n_extra trailing rows are seen by nobody."""
    n = len(parents)
    m = np.zeros((n, n_prefix + n + n_extra), bool)
    m[:, :n_prefix] = True
    for t in range(n):
        a = t
        while a >= 0:
            m[t, n_prefix + a] = True
            a = parents[a]
    return m


def attn_case(rng, n_tok, n_head, n_kv_head, hd, n_kv, kv_dtype, p_visible=0.8):
    q = normal(rng, (n_tok, n_head, hd))
    k = normal(rng, (n_kv, n_kv_head, hd), kv_dtype)
    v = normal(rng, (n_kv, n_kv_head, hd), kv_dtype)
    mask = rng.random((n_tok, n_kv)) < p_visible
    return q, k, v, mask


def attn_atol(isa: str) -> float:
    return ATTN_ATOL_SCALAR if isa == "scalar" else ATTN_ATOL_SIMD


# ---- rmsnorm ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 16, 17, 64, 100, 896, 1536])
def test_rmsnorm_matches_reference(isa, n):
    rng = rng_for("rms", n)
    x, w = normal(rng, (5, n)), normal(rng, n)
    x[3] *= 1e3  # scale invariance up to eps
    out = native.rmsnorm(x, w, 1e-6)
    np.testing.assert_allclose(out, ref.rmsnorm(x, w, 1e-6), rtol=RMSNORM_RTOL, atol=1e-30)


def test_rmsnorm_three_dims_normalises_last_axis(isa):
    rng = rng_for("rms3")
    x, w = normal(rng, (3, 14, 64)), normal(rng, 64)  # q_norm over heads (Qwen3 style)
    np.testing.assert_allclose(native.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6),
                               rtol=RMSNORM_RTOL, atol=1e-30)


@pytest.mark.parametrize("n", [5, 33, 1536])
def test_rmsnorm_row_independent_of_batch_and_alignment(isa, n):
    rng = rng_for("rms-inv", n)
    x, w = normal(rng, (9, n)), normal(rng, n)
    x[6] = x[2]
    full = native.rmsnorm(x, w, 1e-5)
    assert np.array_equal(full[6], full[2])  # same row at another index
    for r in (0, 2, 8):
        assert np.array_equal(native.rmsnorm(x[r : r + 1], w, 1e-5)[0], full[r])
        for shift in (1, 3):  # the row and weights at addresses off the vector alignment
            buf, wbuf = np.zeros(n + shift, np.float32), np.zeros(n + shift, np.float32)
            buf[shift:], wbuf[shift:] = x[r], w
            one = native.rmsnorm(buf[shift:][None], wbuf[shift:], 1e-5)
            assert np.array_equal(one[0], full[r])


def test_rmsnorm_isas_share_scaling_arithmetic():
    """Only the sum of squares may differ across ISAs: for a row whose sum is exact in any
    order (small integers) the outputs must agree bit for bit."""
    rng = rng_for("rms-isa")
    x = rng.integers(-8, 9, (4, 300)).astype(np.float32)
    w = normal(rng, 300)
    outs = []
    for isa in ISAS:
        native.set_isa(isa)
        outs.append(native.rmsnorm(x, w, 1e-6))
    native.set_isa(native.best_isa())
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


# ---- rope -------------------------------------------------------------------------------


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("head_dim,n_rot", [(8, 8), (64, 64), (128, 128), (64, 32), (128, 64)])
def test_rope_matches_reference(isa, neox, head_dim, n_rot):
    rng = rng_for("rope", neox, head_dim, n_rot)
    x = normal(rng, (6, 3, head_dim))
    pos = np.array([0, 1, 5, 5, 4095, 31000], np.int32)  # repeats and large positions
    inv = inv_freq(n_rot, 1e6 if neox else 1e4)
    want = ref.rope(x, pos, n_rot, inv, neox)
    got = x.copy()
    native.rope(got, pos, n_rot, inv, neox)
    np.testing.assert_allclose(got, want, rtol=0, atol=ROPE_ATOL)
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])  # unrotated dims untouched


def test_rope_attn_factor_and_position_zero(isa):
    rng = rng_for("rope-af")
    x = normal(rng, (2, 2, 64))
    pos = np.array([0, 7], np.int32)
    inv = inv_freq(64)
    got = x.copy()
    native.rope(got, pos, 64, inv, True, attn_factor=1.25)
    np.testing.assert_allclose(got, ref.rope(x, pos, 64, inv, True, 1.25), rtol=0, atol=ROPE_ATOL)
    np.testing.assert_allclose(got[0], x[0] * np.float32(1.25), rtol=1e-7)  # theta = 0


def test_rope_neox_is_pairs_mode_on_permuted_dims(isa):
    """neox rotates (i, i + n_rot/2); pairs mode rotates (2i, 2i+1) with the same theta_i.
    Interleaving the halves turns one into the other (how GGUF converters relate them)."""
    rng = rng_for("rope-perm")
    n_rot, hd = 32, 48
    x = normal(rng, (4, 2, hd))
    pos = np.array([3, 3, 9, 100], np.int32)
    inv = inv_freq(n_rot)
    perm = np.concatenate([np.stack([np.arange(16), np.arange(16) + 16], 1).ravel(), np.arange(32, hd)])
    a = x.copy()
    native.rope(a, pos, n_rot, inv, True)
    b = np.ascontiguousarray(x[..., perm])
    native.rope(b, pos, n_rot, inv, False)
    assert np.array_equal(a[..., perm], b)


def test_rope_relative_position_property(isa):
    """RoPE's defining property: q.k after rotation depends only on the position offset."""
    rng = rng_for("rope-rel")
    q, k = normal(rng, (1, 1, 64)), normal(rng, (1, 1, 64))
    inv = inv_freq(64)

    def dot(pq, pk):
        a, b = q.copy(), k.copy()
        native.rope(a, np.array([pq], np.int32), 64, inv, True)
        native.rope(b, np.array([pk], np.int32), 64, inv, True)
        return float(np.dot(a.ravel().astype(np.float64), b.ravel()))

    assert dot(10, 3) == pytest.approx(dot(107, 100), abs=1e-4)
    assert dot(10, 3) != pytest.approx(dot(10, 4), abs=1e-2)


def test_rope_token_independent_of_batch(isa):
    rng = rng_for("rope-inv")
    x = normal(rng, (7, 5, 64))
    x[4] = x[1]
    pos = np.array([2, 9, 9, 3, 9, 0, 40], np.int32)
    inv = inv_freq(48)
    full = x.copy()
    native.rope(full, pos, 48, inv, False)
    assert np.array_equal(full[4], full[1])
    for t in range(7):
        one = x[t : t + 1].copy()
        native.rope(one, pos[t : t + 1], 48, inv, False)
        assert np.array_equal(one[0], full[t])


# ---- swiglu -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 8, 16, 17, 1000, 8960])
def test_swiglu_matches_reference(isa, n):
    rng = rng_for("swiglu", n)
    g, u = normal(rng, n) * 8, normal(rng, n)
    g[: min(n, 4)] = [0.0, -100.0, 100.0, -88.5][: min(n, 4)]  # zero and saturated gates
    rtol = SWIGLU_RTOL_SCALAR if isa == "scalar" else SWIGLU_RTOL_SIMD
    np.testing.assert_allclose(native.swiglu(g, u), ref.swiglu(g, u), rtol=rtol, atol=SWIGLU_ATOL)


def test_swiglu_element_independent_of_index_alignment_and_length(isa):
    rng = rng_for("swiglu-inv")
    n = 200
    g, u = normal(rng, n) * 4, normal(rng, n)
    full = native.swiglu(g, u)
    for start in range(0, 20):
        for length in (1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, n - 20):
            got = native.swiglu(g[start : start + length], u[start : start + length])
            assert np.array_equal(got, full[start : start + length]), (start, length)
    g2 = np.tile(g[:10], 20)  # equal inputs at every residue modulo the vector width
    out = native.swiglu(g2, np.tile(u[:10], 20)).reshape(20, 10)
    assert (out == out[0]).all()


def test_swiglu_2d(isa):
    rng = rng_for("swiglu-2d")
    g, u = normal(rng, (3, 4864)), normal(rng, (3, 4864))
    out = native.swiglu(g, u)
    assert out.shape == (3, 4864)
    assert np.array_equal(out[1], native.swiglu(g[1], u[1]))


# ---- attention: parity ------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("hd", [8, 64, 128])
@pytest.mark.parametrize("n_head,n_kv_head", [(1, 1), (2, 1), (7, 7), (14, 2), (12, 2), (7, 1)])
def test_attention_matches_reference(isa, kv_dtype, hd, n_head, n_kv_head):
    rng = rng_for("attn", np.dtype(kv_dtype).name, hd, n_head, n_kv_head)
    q, k, v, mask = attn_case(rng, 5, n_head, n_kv_head, hd, 70, kv_dtype)
    mask[0] = False
    mask[0, 13] = True  # a token seeing exactly one row gets that row's V
    got = native.attention(q, k, v, mask, hd**-0.5)
    np.testing.assert_allclose(got, ref.attention(q, k, v, mask, hd**-0.5), rtol=0, atol=attn_atol(isa))
    np.testing.assert_allclose(got[0], v[13].astype(np.float32).repeat(n_head // n_kv_head, 0),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("hd", [8, 40, 80, 96, 256])  # non-power-of-two and wide heads
def test_attention_odd_head_dims(isa, kv_dtype, hd):
    rng = rng_for("attn-hd", np.dtype(kv_dtype).name, hd)
    q, k, v, mask = attn_case(rng, 3, 4, 2, hd, 37, kv_dtype)
    got = native.attention(q, k, v, mask, 0.3)
    np.testing.assert_allclose(got, ref.attention(q, k, v, mask, 0.3), rtol=0, atol=attn_atol(isa))


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_attention_single_kv_row(isa, kv_dtype):
    rng = rng_for("attn-1", np.dtype(kv_dtype).name)
    q, k, v, _ = attn_case(rng, 2, 4, 2, 64, 1, kv_dtype)
    mask = np.ones((2, 1), bool)
    got = native.attention(q, k, v, mask, 0.125)
    np.testing.assert_allclose(got, v.astype(np.float32)[0].repeat(2, 0)[None].repeat(2, 0),
                               rtol=0, atol=1e-6)


def test_attention_fully_masked_token_is_zero(isa):
    rng = rng_for("attn-0")
    q, k, v, mask = attn_case(rng, 3, 4, 2, 64, 20, np.float16)
    mask[1] = False
    out = np.full_like(q, np.nan)
    native.attention(q, k, v, mask, 0.125, out=out)
    assert np.array_equal(out[1], np.zeros_like(out[1]))
    np.testing.assert_allclose(out, ref.attention(q, k, v, mask, 0.125), rtol=0, atol=attn_atol(isa))
    none = native.attention(q, k, v, np.zeros_like(mask), 0.125)
    assert not none.any()


def test_attention_large_scores_are_stable(isa):
    """Scores in the hundreds: exp without subtracting the max would overflow."""
    rng = rng_for("attn-big")
    q, k, v, mask = attn_case(rng, 2, 2, 1, 64, 50, np.float32)
    q *= 30
    got = native.attention(q, k, v, mask, 1.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref.attention(q, k, v, mask, 1.0), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
def test_attention_long_context(isa, kv_dtype):
    rng = rng_for("attn-long", np.dtype(kv_dtype).name)
    n_kv = 32768
    q, k, v, _ = attn_case(rng, 2, 4, 2, 64, n_kv, kv_dtype)
    q *= 3  # peaked enough that outputs are O(0.1-1), not averages of noise
    mask = np.ones((2, n_kv), bool)
    mask[1, n_kv // 2 :] = False
    got = native.attention(q, k, v, mask, 64**-0.5)
    np.testing.assert_allclose(got, ref.attention(q, k, v, mask, 64**-0.5), rtol=0, atol=ATTN_ATOL_LONG)


def test_attention_tree_mask_with_repeated_positions(isa):
    """Token tree: prefix of 40 rows, then 6 draft tokens; siblings share positions (rope),
    each sees the prefix and its ancestors only."""
    rng = rng_for("attn-tree")
    parents = [-1, 0, 0, 1, 1, 2]
    pos = 40 + np.array([0, 1, 1, 2, 2, 2], np.int32)
    n_head, n_kv_head, hd = 14, 2, 64
    mask = tree_mask(parents, 40)
    inv = inv_freq(hd, 1e6)
    q = normal(rng, (6, n_head, hd))
    k_new = normal(rng, (6, n_kv_head, hd))
    native.rope(q, pos, hd, inv, True)
    native.rope(k_new, pos, hd, inv, True)
    k = np.concatenate([normal(rng, (40, n_kv_head, hd)), k_new]).astype(np.float16)
    v = normal(rng, (46, n_kv_head, hd), np.float16)
    got = native.attention(q, k, v, mask, hd**-0.5)
    np.testing.assert_allclose(got, ref.attention(q, k, v, mask, hd**-0.5), rtol=0, atol=attn_atol(isa))


def test_attention_rejects_bad_group():
    q = np.zeros((1, 3, 8), np.float32)
    kv = np.zeros((2, 2, 8), np.float32)
    with pytest.raises(LeverError):
        native.attention(q, kv, kv, np.ones((1, 2), bool), 1.0)


# ---- attention: batch invariance --------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_head,n_kv_head,hd", [(12, 2, 128), (14, 2, 64), (7, 7, 8), (2, 1, 64)])
def test_attention_token_bit_identical_alone_and_in_batch(isa, kv_dtype, n_head, n_kv_head, hd):
    """A token's output must not depend on other tokens, on rows it cannot see (filled with
    NaN here: they must never be read), on extra rows past the ones it sees, or on threads."""
    rng = rng_for("attn-inv", np.dtype(kv_dtype).name, n_head, n_kv_head, hd)
    parents = [-1, 0, 1, 1, 0, 4, 2, 6, 3]
    n_prefix = 45
    mask = tree_mask(parents, n_prefix, n_extra=11)
    mask[:, 5] = False  # a hole in the prefix
    n_tok, n_kv = mask.shape
    q = normal(rng, (n_tok, n_head, hd))
    k = normal(rng, (n_kv, n_kv_head, hd), kv_dtype)
    v = normal(rng, (n_kv, n_kv_head, hd), kv_dtype)
    k[5], v[5] = np.nan, np.nan
    k[-11:], v[-11:] = np.nan, np.nan  # rows nobody sees

    batch = {nt: native.attention(q, k, v, mask, hd**-0.5, n_threads=nt) for nt in (1, 2, 3, 5, 8, 13)}
    for nt, out in batch.items():
        assert np.isfinite(out).all()
        assert np.array_equal(out, batch[1]), f"n_threads={nt}"
    for t in range(n_tok):
        rows = np.flatnonzero(mask[t])
        # alone, with the full cache and its own mask row; one token leaves threads idle, so
        # the thread count also changes how a kv group's heads are split into work units
        for nt in (1, 2, 3, 5, 13):
            alone = native.attention(q[t : t + 1], k, v, mask[t : t + 1], hd**-0.5, n_threads=nt)
            assert np.array_equal(alone[0], batch[1][t]), (t, nt)
        # alone, with only the rows it sees (a different n_kv and no masked rows at all)
        kc, vc = np.ascontiguousarray(k[rows]), np.ascontiguousarray(v[rows])
        compact = native.attention(q[t : t + 1], kc, vc, np.ones((1, rows.size), bool), hd**-0.5,
                                   n_threads=1)
        assert np.array_equal(compact[0], batch[1][t]), t


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_head,n_kv_head,hd", [(12, 2, 128), (14, 2, 64), (7, 1, 40)])
def test_attention_head_identical_alone_and_in_group(isa, kv_dtype, n_head, n_kv_head, hd):
    """A query head gives the same bits as a one-head model over its kv head: the kernels
    may compute heads of a group together, but never with different arithmetic."""
    rng = rng_for("attn-head", np.dtype(kv_dtype).name, n_head, n_kv_head, hd)
    q, k, v, mask = attn_case(rng, 3, n_head, n_kv_head, hd, 53, kv_dtype)
    full = native.attention(q, k, v, mask, hd**-0.5)
    group = n_head // n_kv_head
    for h in range(n_head):
        g = h // group
        kg, vg = np.ascontiguousarray(k[:, g : g + 1]), np.ascontiguousarray(v[:, g : g + 1])
        one = native.attention(np.ascontiguousarray(q[:, h : h + 1]), kg, vg, mask, hd**-0.5)
        assert np.array_equal(one[:, 0], full[:, h]), h


def test_attention_duplicate_tokens_identical(isa):
    """Two tokens with the same query and the same visible rows, at different batch
    positions and with different neighbours, give identical outputs."""
    rng = rng_for("attn-dup")
    q, k, v, mask = attn_case(rng, 6, 12, 2, 128, 300, np.float16)
    q[4], mask[4] = q[1], mask[1]
    out = native.attention(q, k, v, mask, 128**-0.5)
    assert np.array_equal(out[4], out[1])


# ---- ISA selection ----------------------------------------------------------------------


def test_isa_paths_exist():
    assert "scalar" in ISAS
    assert native.best_isa() in ISAS


def test_top_k_is_a_stable_sort_prefix():
    """native.top_k: the k largest by falling value, ties to the lower index, NaN never chosen,
    as a stable descending sort gives them (for k = 1 and k = n too); k over a row's numbers is
    an error."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 1000)).astype(np.float32)
    x[1, [3, 400, 999]] = 9.0  # ties at the top
    x[2, ::2] = np.nan
    x[3] = 0.5  # all equal
    for k in (1, 4, 16):
        ids, vals = native.top_k(x, k)
        want = np.argsort(-np.nan_to_num(x, nan=-np.inf), axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(vals, np.take_along_axis(x, want, -1))
    ids, _ = native.top_k(x[:1], 1000)
    np.testing.assert_array_equal(ids[0], np.argsort(-x[0], kind="stable"))
    with pytest.raises(LeverError, match="bad shape"):
        native.top_k(x[2:3], 501)  # 500 numbers, 500 NaN
