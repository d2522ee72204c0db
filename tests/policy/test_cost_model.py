"""The cost model on synthetic profiles (exact numbers, no timing): the pipelined pass,
interpolation, flash emulation, the fallback, and trees that grow on slow flash."""

from __future__ import annotations

import attrs
import pytest

from lever.backends.flash import FlashConfig, FlashStore
from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.identity import ModelIdentity
from lever.pipelines.plan import cost_model
from lever.policy.cost_model import CostModel, interpolate, layer_read_bytes
from lever.policy.profile import HEAD_ROWS, TOKEN_BUCKETS, DraftProfile, FlashProfile, Profile, TargetProfile, write

N_LAYER = 28
LAYER_BYTES = 30_000_000


def layer_s(n: float) -> float:
    return 1e-3 + 2e-4 * n  # 1 ms of fixed cost, 0.2 ms a token


def resident_layer_s(n: float) -> float:
    return 0.4e-3 + 1e-4 * n  # a resident layer, in the tile layout: faster


def make_profile(bw=1.5e9, cap=0.0, latency_ms=0.0, target_id=None, draft_id=None, layer_table=None,
                 resident_table=None) -> Profile:
    fid = ModelIdentity("t.gguf", 1, "0" * 64)
    flash = FlashProfile(mode="direct", queue_depth=4, chunk_bytes=2 * 2**20, bandwidth_cap_bytes_per_s=cap,
                         read_latency_ms=latency_ms, pass_bytes=N_LAYER * LAYER_BYTES, read_bytes_per_s=bw,
                         small_read_s=1e-4, chunk_read_s=2e-3, device_read_bytes_per_s=2 * bw, device_small_read_s=5e-5)
    target = TargetProfile(model=target_id or fid, n_layer=N_LAYER, kv_rows=256, tokens=TOKEN_BUCKETS,
                           layer_s=layer_table or tuple(layer_s(n) for n in TOKEN_BUCKETS),
                           resident_layer_s=resident_table or layer_table or tuple(layer_s(n) for n in TOKEN_BUCKETS),
                           layers_timed=(0, 1), head_rows=HEAD_ROWS, head_s=tuple(0.02 + 0.002 * n for n in HEAD_ROWS))
    draft = DraftProfile(draft_id or fid, 24, 256, TOKEN_BUCKETS, tuple(0.05 + 0.002 * n for n in TOKEN_BUCKETS),
                         HEAD_ROWS, tuple(0.01 + 0.001 * n for n in HEAD_ROWS))
    return Profile(device="cpu", platform="linux", threads=2, date="2026-01-01T00:00:00+00:00", method="synthetic",
                   lever_version="0.1.0", flash=flash, target=target, draft=draft)


def model(bw=1.5e9, resident=(), **kw) -> CostModel:
    cm = CostModel.from_profile(make_profile(**kw), [0 if i in resident else LAYER_BYTES for i in range(N_LAYER)])
    return cm.with_read_bytes_per_s(bw)


SLOW, FAST = model(bw=0.5e9), model(bw=1000e9)  # reads dominate / compute dominates


@pytest.mark.parametrize("cm", [SLOW, FAST, model(bw=8e9), model(resident=range(0, N_LAYER, 3))])
def test_verify_is_monotonic_and_between_overlap_bounds(cm):
    prev = 0.0
    for n in range(1, 200):
        v = cm.verify_s(n)
        assert v >= prev
        assert max(cm.read_s, cm.compute_s(n)) - 1e-12 <= v <= cm.read_s + cm.compute_s(n) + cm.read_latency_s + 1e-12
        prev = v


def test_marginal_cost_is_near_zero_while_reads_dominate():
    per_token_layer = layer_s(2) - layer_s(1)
    for n in (1, 8, 32, 63):
        # Only the last layer's compute follows the last read: one layer's share, not 28.
        assert SLOW.marginal_verify_s(n) == pytest.approx(per_token_layer)
        assert FAST.marginal_verify_s(n) == pytest.approx(N_LAYER * per_token_layer, rel=1e-6)
    assert SLOW.verify_s(64) - SLOW.verify_s(1) < 0.01 * SLOW.verify_s(1)


def test_read_bound_pass_is_read_plus_last_layer_and_compute_bound_is_first_read_plus_compute():
    assert SLOW.verify_s(8) == pytest.approx(SLOW.read_latency_s + SLOW.read_s + layer_s(8))
    first_read = SLOW.read_latency_s + LAYER_BYTES / 1000e9
    assert FAST.verify_s(8) == pytest.approx(first_read + FAST.compute_s(8))


def test_resident_layers_cost_compute_only():
    cm = model(resident=range(N_LAYER))
    assert cm.streamed_layers == () and cm.read_s == 0
    assert cm.verify_s(16) == pytest.approx(N_LAYER * layer_s(16))
    # Fewer bytes to read, and resident layers' compute for the reads to hide under.
    assert model(bw=4e9, resident=range(0, N_LAYER, 2)).verify_s(1) < model(bw=4e9).verify_s(1)


def test_a_small_window_stalls_reads_behind_compute():
    cm = model(bw=4e9)
    one = CostModel.from_profile(make_profile(), cm.layer_read_bytes, FlashConfig(window_layers=1))
    assert one.with_read_bytes_per_s(4e9).verify_s(32) > cm.verify_s(32)


def test_interpolation_is_linear_between_buckets_and_beyond():
    cm = model()
    for n in TOKEN_BUCKETS:
        assert cm.layer_compute_s(n) == pytest.approx(layer_s(n))
    assert cm.layer_compute_s(3) == pytest.approx((layer_s(2) + layer_s(4)) / 2)
    assert cm.layer_compute_s(48) == pytest.approx((layer_s(32) + layer_s(64)) / 2)
    assert cm.layer_compute_s(128) == pytest.approx(layer_s(64) + 64 * (layer_s(64) - layer_s(32)) / 32)
    assert interpolate((4,), (2.0,), 8) == 4.0  # one bucket: proportional
    assert cm.lm_head_s(0) == 0 and cm.lm_head_s(8) == pytest.approx(0.02 + 0.016)
    assert cm.draft_s(16) == pytest.approx(0.05 + 0.032) and cm.draft_lm_head_s(1) == pytest.approx(0.011)
    assert cm.expand_s(4) == pytest.approx(cm.draft_s(4) + cm.draft_lm_head_s(4))


def test_noisy_tables_are_made_monotonic():
    noisy = (3e-3, 2.9e-3, 4e-3, 3.5e-3, 6e-3, 9e-3, 1.5e-2)
    cm = model(layer_table=noisy)
    assert cm.layer_s == (3e-3, 3e-3, 4e-3, 4e-3, 6e-3, 9e-3, 1.5e-2)
    assert all(cm.layer_compute_s(n + 1) >= cm.layer_compute_s(n) for n in range(1, 100))


def test_flash_settings_of_the_run_apply_to_the_profiled_device():
    p = make_profile(bw=1.5e9)  # device 3e9 in make_profile; profiled with no emulation
    bytes_ = [LAYER_BYTES] * N_LAYER
    assert CostModel.from_profile(p, bytes_).read_bytes_per_s == 1.5e9  # as profiled
    assert CostModel.from_profile(p, bytes_, FlashConfig()).read_bytes_per_s == 1.5e9
    capped = CostModel.from_profile(p, bytes_, FlashConfig(bandwidth_cap_bytes_per_s=0.5e9))
    assert capped.read_bytes_per_s == 0.5e9
    assert CostModel.from_profile(p, bytes_, FlashConfig(bandwidth_cap_bytes_per_s=9e9)).read_bytes_per_s == 3e9
    slow = CostModel.from_profile(p, bytes_, FlashConfig(read_latency_ms=50, queue_depth=1))
    assert slow.read_latency_s == pytest.approx(0.05 + 5e-5) and slow.read_bytes_per_s < 2 * 2**20 / 0.05
    # Profiled under a cap, run under the same cap: the measured figure stands.
    cap = FlashConfig(bandwidth_cap_bytes_per_s=0.5e9)
    same = CostModel.from_profile(make_profile(bw=0.49e9, cap=0.5e9), bytes_, cap)
    assert same.read_bytes_per_s == 0.49e9


def best_tree(cm: CostModel, accept: float = 0.8, max_nodes: int = 200) -> int:
    """Drafted nodes maximizing tokens per second when the k-th best node is accepted with
    probability accept^k (a toy TreeExpand: one batched expansion, one verification pass)."""
    def rate(m: int) -> float:
        tokens = 1 + sum(accept ** k for k in range(1, m + 1))
        return tokens / (cm.verify_s(m + 1) + (cm.expand_s(m) if m else 0.0))
    return max(range(max_nodes), key=rate)


def test_trees_grow_on_slow_flash_and_shrink_on_fast():
    sizes = [best_tree(model(bw=bw)) for bw in (0.25e9, 0.5e9, 2e9, 1000e9)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(LeverError, match="at least 1 token"):
        SLOW.verify_s(0)
    with pytest.raises(LeverError, match="size must be >= 0"):
        SLOW.draft_s(-1)
    with pytest.raises(LeverError, match="3 layers given, the profiled target has 28"):
        CostModel.from_profile(make_profile(), [1, 2, 3])
    no_draft = CostModel(layer_read_bytes=SLOW.layer_read_bytes, read_bytes_per_s=1e9, read_latency_s=0.0,
                         window_layers=3, tokens=(1,), layer_s=(1e-3,), head_rows=(1,), head_s=(1e-3,), source="x")
    with pytest.raises(LeverError, match="no draft model"):
        no_draft.draft_s(1)


def test_layer_read_bytes_match_the_flash_store(tiny_model):
    path = tiny_model("qwen2", "Q4_0", n_layer=4)
    for budget in (0, "50%", 1.0):
        flash = FlashConfig(mode="mmap", dram_budget=budget, chunk_bytes=8192)
        got = layer_read_bytes(path, flash)
        with FlashStore(path, flash) as store:
            assert [i for i, b in enumerate(got) if b] == list(store.streamed)
            assert sum(got) == store.streamed_bytes


def test_fallback_from_the_files_alone(tiny_model):
    target, draft = tiny_model("qwen2", "Q4_0", n_layer=4), tiny_model("qwen2", "Q8_0", n_layer=2, seed=3)
    cm = CostModel.default(target, FlashConfig(bandwidth_cap_bytes_per_s=0.5e9), draft)
    assert cm.source == "fallback" and cm.read_bytes_per_s == 0.5e9 and cm.n_layer == 4
    assert all(b > a for a, b in zip(cm.layer_s, cm.layer_s[1:]))  # compute-bound buckets grow
    assert cm.draft_s(8) > 0 and cm.lm_head_s(1) > 0
    assert all(cm.verify_s(n + 1) >= cm.verify_s(n) for n in range(1, 100))
    assert CostModel.default(target).read_bytes_per_s == 2.1e9 and not CostModel.default(target).draft_batch


def test_config_picks_the_profile_or_the_fallback(tiny_model, tmp_path):
    target, draft = tiny_model("qwen2", "Q4_0", n_layer=4), tiny_model("qwen2", "Q8_0", n_layer=2, seed=3)
    base = [f"model.target='{target}'", f"model.draft='{draft}'", "flash.mode='mmap'"]
    assert cost_model(load_config(None, base)).source == "fallback"

    p = make_profile(target_id=ModelIdentity.of(target), draft_id=ModelIdentity.of(draft))
    p = attrs.evolve(p, target=attrs.evolve(p.target, n_layer=4))
    path = write(p, tmp_path / "p.msgpack")
    cm = cost_model(load_config(None, base + [f"profile.path='{path}'"]))
    assert cm.source == f"profile {path}" and cm.n_layer == 4 and cm.draft_batch == TOKEN_BUCKETS

    wrong = write(make_profile(), tmp_path / "wrong.msgpack")
    with pytest.raises(LeverError, match=rf"{wrong}: profiled target t.gguf is not the configured"):
        cost_model(load_config(None, base + [f"profile.path='{wrong}'"]))
    with pytest.raises(LeverError, match=rf"{tmp_path / 'gone.msgpack'}: no such profile file"):
        cost_model(load_config(None, base + [f"profile.path='{tmp_path / 'gone.msgpack'}'"]))


def test_an_emulated_slow_verification_unit_is_in_the_cost_model(tiny_model):
    target, draft = tiny_model("qwen2", "Q4_0", n_layer=4), tiny_model("qwen2", "Q8_0", n_layer=2, seed=3)
    base = [f"model.target='{target}'", f"model.draft='{draft}'", "flash.mode='mmap'"]
    cpu = cost_model(load_config(None, base))
    npu = cost_model(load_config(None, base + ["runtime.emulate_layer_ms_per_token=2.0"]))
    assert npu.layer_compute_s(32) == pytest.approx(max(cpu.layer_compute_s(32), 32 * 2e-3))
    assert npu.layer_compute_s(64) > npu.layer_compute_s(32) >= 0.064 - 1e-12
    assert npu.marginal_verify_s(20) > cpu.marginal_verify_s(20)  # bigger trees cost more: they shrink


def test_a_what_if_read_speed_prices_the_run(tiny_model):
    """[runtime] what_if_read_bytes_per_s: the run's model reads at the what-if's speed, marked so
    the online corrections leave it (tests/policy/test_online.py), its compute unchanged."""
    target, draft = tiny_model("qwen2", "Q4_0", n_layer=4), tiny_model("qwen2", "Q8_0", n_layer=2, seed=3)
    base = [f"model.target='{target}'", f"model.draft='{draft}'", "flash.mode='mmap'"]
    here = cost_model(load_config(None, base))
    phone = cost_model(load_config(None, base + ["runtime.what_if_read_bytes_per_s=4.2e9"]))
    assert phone.read_bytes_per_s == 4.2e9 and phone.read_what_if and not here.read_what_if
    assert phone.compute_s(16) == here.compute_s(16) and "what-if" in phone.source


def test_resident_layers_are_priced_by_their_own_table():
    """A resident layer (tile layout) costs what the profile measured for resident layers, a
    streamed one what it measured for streamed ones: with every layer resident a pass is the
    resident table, with every layer streamed and compute-bound it is the streamed one."""
    prof = make_profile(resident_table=tuple(resident_layer_s(n) for n in TOKEN_BUCKETS))
    everything_resident = CostModel.from_profile(prof, [0] * N_LAYER)
    assert everything_resident.verify_s(16) == pytest.approx(N_LAYER * resident_layer_s(16))
    assert everything_resident.compute_s(8) == pytest.approx(N_LAYER * resident_layer_s(8))
    half = CostModel.from_profile(prof, [0] * 14 + [1] * 14)  # 14 streamed layers of 1 byte: compute-bound
    assert half.compute_s(8) == pytest.approx(14 * resident_layer_s(8) + 14 * layer_s(8))
    assert half.verify_s(8) == pytest.approx(half.compute_s(8), rel=1e-3)  # 1-byte reads: compute-bound
    assert everything_resident.layer_compute_s(4) == pytest.approx(layer_s(4))  # a streamed layer, asked alone


def test_a_head_start_takes_the_window_off_a_read_bound_pass():
    window = SLOW.window_layers * LAYER_BYTES / SLOW.read_bytes_per_s
    cold = SLOW.verify_s(8)
    assert SLOW.verify_s(8, head_start_s=window / 2) == pytest.approx(cold - window / 2)
    # the reader stops when the window is full: a longer head start hides no more, and the
    # next read waits for the first layer's compute to free its buffer
    full = cold - window - SLOW.read_latency_s + layer_s(8)
    assert SLOW.verify_s(8, head_start_s=10 * window) == pytest.approx(full)
    assert SLOW.verify_s(8, head_start_s=2 * window) == pytest.approx(full)
    # compute bound: the first layer's read was the only wait, and it is gone
    assert FAST.verify_s(8, head_start_s=1.0) == pytest.approx(FAST.compute_s(8))


def test_a_cycle_is_drafting_the_pass_and_accept():
    draft_s = 0.05
    c = SLOW.cycle_s(16, draft_s, accept_rows=5)
    assert c == pytest.approx(draft_s + SLOW.verify_s(16, head_start_s=draft_s + SLOW.accept_s(5)) + SLOW.accept_s(5))
    # drafting in turns costs less than its own length while the reader fills the window meanwhile
    assert SLOW.cycle_s(16, draft_s, 5) - SLOW.cycle_s(16, 0.0, 5) < draft_s
    assert FAST.cycle_s(16, draft_s, 5) - FAST.cycle_s(16, 0.0, 5) == pytest.approx(draft_s, rel=0.05)


def test_scaled_models_stretch_each_part_alone():
    cm = model(bw=2e9)
    slow_reads = cm.scaled(read=2.0)
    assert slow_reads.read_s == pytest.approx(2 * cm.read_s)
    assert slow_reads.compute_s(8) == cm.compute_s(8) and slow_reads.expand_s(4) == cm.expand_s(4)
    busy = cm.scaled(compute=1.5, draft=2.0, head=3.0)
    assert busy.compute_s(8) == pytest.approx(1.5 * cm.compute_s(8))
    assert busy.expand_s(4) == pytest.approx(2.0 * cm.expand_s(4))
    assert busy.accept_s(3) == pytest.approx(3.0 * cm.accept_s(3)) and busy.read_s == cm.read_s
