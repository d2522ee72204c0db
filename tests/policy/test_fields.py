"""Files Lever writes and reads back (profile, predictor artifact, saved session), mutated field
by field and byte by byte: each mutation is either read back as a valid object or refused with
one LeverError line naming the file, never another exception."""

from __future__ import annotations

import copy
import math
import types

import msgpack
import numpy as np
import pytest

from lever.backends.cpu.kv_cache import KVCache
from lever.errors import LeverError
from lever.fuzz.files import paths_in
from lever.gguf.identity import ModelIdentity
from lever.pipelines import saved_session
from lever.pipelines.compose import KVState
from lever.policy import profile as profile_mod
from lever.policy.acceptance import AcceptanceTable
from lever.policy.cost_model import CostModel
from lever.policy.predictor import Artifact, Correction, scores
from lever.policy.profile import HEAD_ROWS, TOKEN_BUCKETS, DraftProfile, FlashProfile, Profile, TargetProfile

N_MUTATIONS = 300  # per kind here; a few thousand were run by hand (see the class 3 report)

_ODD_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.5, -0.0, math.nan, math.inf,
               -math.inf, 1e308, -1e308, 1e-308, "", "x", "é\n\x00", b"", b"\x00" * 3, [], [1], [[]], {}, {"a": 1},
               msgpack.ExtType(5, b"\x00")]


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def mutate(raw: bytes, rng: np.random.Generator) -> bytes:
    """One random mutation of a msgpack file: a value's type or number changed, a key deleted,
    a list lengthened or shortened, or the bytes themselves truncated, flipped or replaced."""
    choice = rng.integers(10)
    if choice == 0:
        return raw[: rng.integers(len(raw))]
    if choice == 1:
        b = bytearray(raw)
        for _ in range(rng.integers(1, 8)):
            b[rng.integers(len(b))] = rng.integers(256)
        return bytes(b)
    if choice == 2:
        return [b"", b"{\"format\": 1}", b"\xc1", rng.bytes(64), raw + b"\x00"][rng.integers(5)]
    doc = msgpack.unpackb(raw, raw=False)
    for _ in range(rng.integers(1, 4)):
        paths = list(paths_in(doc))
        path, value = paths[rng.integers(len(paths))]
        op = rng.integers(6)
        if op == 0 and path:  # delete
            parent = doc
            for k in path[:-1]:
                parent = parent[k]
            del parent[path[-1]]
        elif op == 1 and isinstance(value, list):  # another length
            doc = _set(doc, path, value[:-1] if value and rng.integers(2) else value + value[-1:] + [0])
        elif op == 2 and isinstance(value, (int, float)) and not isinstance(value, bool):  # another number
            doc = _set(doc, path, [-value, value * 1e300 if isinstance(value, float) else 2**63 - 1, math.nan,
                                   -1, 0, value + 1][rng.integers(6)])
        else:  # another type
            doc = _set(doc, path, copy.deepcopy(_ODD_VALUES[rng.integers(len(_ODD_VALUES))]))
    try:
        return msgpack.packb(doc, use_bin_type=True)
    except OverflowError:  # a number msgpack cannot hold (past 64 bits): it cannot be in a file either
        return raw


def _identity(path) -> ModelIdentity:
    return ModelIdentity(str(path), 5000, "ab" * 32)


def _profile(tmp_path) -> Profile:
    n = len(TOKEN_BUCKETS)
    fl = FlashProfile(mode="direct", queue_depth=4, chunk_bytes=1 << 20, bandwidth_cap_bytes_per_s=0.0,
                      read_latency_ms=0.0, pass_bytes=10 << 20, read_bytes_per_s=2e9, small_read_s=1e-4,
                      chunk_read_s=5e-4, device_read_bytes_per_s=2e9, device_small_read_s=1e-4)
    t = TargetProfile(model=_identity(tmp_path / "t.gguf"), n_layer=4, kv_rows=256, tokens=TOKEN_BUCKETS,
                      layer_s=tuple(1e-3 * (i + 1) for i in range(n)),
                      resident_layer_s=tuple(5e-4 * (i + 1) for i in range(n)), layers_timed=(0, 2),
                      head_rows=HEAD_ROWS, head_s=(1e-4, 2e-4, 1e-3))
    d = DraftProfile(_identity(tmp_path / "d.gguf"), 2, 256, TOKEN_BUCKETS, tuple(1e-3 for _ in range(n)), HEAD_ROWS,
                     (1e-5, 2e-5, 1e-4))
    return Profile(device="cpu", platform="linux", threads=2, date="2026-01-01T00:00:00Z", method="test",
                   lever_version="0", flash=fl, target=t, draft=d, load_avg_1min=(0.5, 0.7))


def _use_profile(p: Profile) -> None:
    """What a run does with a profile it read: a cost model, and the trees' prices."""
    cm = CostModel.from_profile(p, [1 << 20] * p.target.n_layer)
    for n in (1, 7, 64, 300):
        draft_s = cm.draft_s(n) if p.draft is not None else 1e-3
        assert math.isfinite(cm.verify_s(n)) and math.isfinite(cm.cycle_s(n, draft_s, n))


def _artifact(tmp_path) -> tuple[Artifact, object]:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(5000))
    cal = AcceptanceTable()
    cal.observe(0.9, 0, True)
    cal.observe(0.3, 1, False)
    return Artifact(ModelIdentity.of(model), "cd" * 32, 1, 0.1, Correction(2.0, 0.5, -1.0), cal, {"x": 1}), model


def _use_artifact(a: Artifact) -> None:
    """What a run does with an artifact: TreeExpand's gains through the table, the predictor's scores."""
    for q in (0.0, 0.3, 1.0):
        for rank in (0, 1, 3):
            assert 0 <= a.acceptance(q, rank) <= 1
    assert 0 <= a.acceptance.first_child() <= 1
    s = scores(np.array([30.0, -5.0, 0.0]), np.array([0.9, 0.05, 1e-12]), a.correction)
    assert np.isfinite(s).all()


_SPEC = types.SimpleNamespace(n_layer=2, n_head_kv=2, head_dim=4)


def _kv(n_ctx: int = 16) -> KVState:
    return KVState(KVCache(_SPEC, n_ctx), KVCache(_SPEC, n_ctx), 0)


def _session(tmp_path):
    kv = _kv()
    rng = np.random.default_rng(0)
    for cache in (kv.target, kv.draft):
        for a in cache.k + cache.v:
            a[:5] = rng.standard_normal(a[:5].shape)
    kv.n_rows = 5
    t, d = _identity(tmp_path / "t.gguf"), _identity(tmp_path / "d.gguf")
    path = tmp_path / "s.msgpack"
    saved_session.write(path, messages=[{"role": "user", "content": "hi"}], ids=[1, 2, 3, 4, 5], kv=kv,
                        target=t, draft=d)
    return path, t, d


def _refused_in_one_line(path, fn) -> None:
    try:
        fn()
    except LeverError as e:
        msg = str(e)
        assert msg.startswith(f"{path}: ") and "\n" not in msg and len(msg) < 400, msg


def _fuzz(tmp_path, raw: bytes, load, seed: int, n: int = N_MUTATIONS) -> int:
    """Mutations of `raw` through `load`; how many were accepted."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "mutated.msgpack"
    accepted = []
    for _ in range(n):
        path.write_bytes(mutate(raw, rng))
        _refused_in_one_line(path, lambda: accepted.append(load(path)))
    return len(accepted)


def test_mutated_profiles_are_read_or_refused_in_one_line(tmp_path):
    good = profile_mod.write(_profile(tmp_path), tmp_path / "p.msgpack")
    _use_profile(profile_mod.read(good))
    _fuzz(tmp_path, good.read_bytes(), lambda p: _use_profile(profile_mod.read(p)), seed=1)


def test_mutated_artifacts_are_read_or_refused_in_one_line(tmp_path):
    art, model = _artifact(tmp_path)
    good = tmp_path / "a.msgpack"
    art.write(good)
    _use_artifact(Artifact.read(good, model, n_layer=4))
    _fuzz(tmp_path, good.read_bytes(), lambda p: _use_artifact(Artifact.read(p, model, n_layer=4)), seed=2)


def test_mutated_sessions_are_read_or_refused_in_one_line(tmp_path):
    path, t, d = _session(tmp_path)

    def load(p):
        saved_session.load(p)
        kv = _kv()
        saved_session.read(p, kv=kv, target=t, draft=d, n_vocab=100)
        assert kv.n_rows <= 16

    load(path)
    _fuzz(tmp_path, path.read_bytes(), load, seed=3)


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.update(layer="3"), "layer: is the string '3', expected an integer"),
    (lambda d: d.update(layer=-2), r"layer: = -2 is out of range"),
    (lambda d: d.update(threshold=math.nan), "threshold: = nan is not a finite number"),
    (lambda d: d["calibration"].update(trials=[[], []]), r"calibration.trials\[0\]: has 0 entries"),
    (lambda d: d["calibration"].update(trials=[[1.0] * 10]), "calibration.trials: has 1 entries, expected 2"),
    (lambda d: d["calibration"]["accepted"][0].__setitem__(3, 5.0),
     r"calibration.accepted\[0\]\[3\]: = 5 is more than"),
    (lambda d: d["calibration"].update(prior_weight=0), "calibration.prior_weight: = 0.0 is out of range"),
    (lambda d: d["correction"].pop("scale"), "correction.scale: missing"),
    (lambda d: d.update(model_sha256=7), "model_sha256: is int 7, expected a string"),
    (lambda d: d.update(version=True), "version"),
])
def test_an_artifact_field_at_fault_is_named(tmp_path, change, field):
    art, model = _artifact(tmp_path)
    good = tmp_path / "a.msgpack"
    art.write(good)
    doc = msgpack.unpackb(good.read_bytes())
    change(doc)
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(msgpack.packb(doc))
    with pytest.raises(LeverError, match=rf"^{bad}: {field}"):
        Artifact.read(bad, model)


def test_an_artifact_layer_past_the_model_names_the_file(tmp_path):
    art, model = _artifact(tmp_path)
    good = tmp_path / "a.msgpack"
    art.write(good)
    with pytest.raises(LeverError, match=rf"^{good}: layer: 1 is not a middle layer of a 2-layer target"):
        Artifact.read(good, model, n_layer=2)


@pytest.mark.parametrize(("path", "value", "field"), [
    (("flash", "mode"), "tape", r"profile.flash.mode: 'tape' is not one of 'direct', 'mmap'"),
    (("flash", "read_bytes_per_s"), 0.0, r"profile.flash.read_bytes_per_s: = 0.0 is out of range"),
    (("flash", "queue_depth"), -3, r"profile.flash.queue_depth: = -3 is out of range"),
    (("target", "layer_s"), [1e-3], r"profile.target: .*1 timings"),
    (("target", "head_s", 1), math.inf, r"profile.target.head_s\[1\]: = inf is not a finite number"),
    (("target", "layers_timed"), [0, 9], r"profile.target.layers_timed: layer 9 of a 4-layer model"),
    (("target", "model", "sha256_first_mib"), "zz", r"profile.target.model.sha256_first_mib: 'zz' is not"),
    (("threads",), "2", r"profile.threads: is the string '2', expected an integer"),
])
def test_a_profile_field_at_fault_is_named(tmp_path, path, value, field):
    good = profile_mod.write(_profile(tmp_path), tmp_path / "p.msgpack")
    doc = msgpack.unpackb(good.read_bytes())
    _set(doc["profile"], path, value)
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(msgpack.packb(doc))
    with pytest.raises(LeverError, match=rf"^{bad}: {field}"):
        profile_mod.read(bad)


def test_a_session_field_at_fault_is_named_and_nothing_is_half_loaded(tmp_path):
    path, t, d = _session(tmp_path)
    doc = msgpack.unpackb(path.read_bytes())
    doc["messages"][0]["role"] = "narrator"
    doc["draft_kv"]["v"][1] = doc["draft_kv"]["v"][1][:-1]
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(msgpack.packb(doc))
    with pytest.raises(LeverError, match=rf"^{bad}: messages\[0\].role: 'narrator' is not one of"):
        saved_session.load(bad)
    doc["messages"][0]["role"] = "user"
    bad.write_bytes(msgpack.packb(doc))
    kv = _kv()
    with pytest.raises(LeverError, match=rf"^{bad}: draft_kv.v\[1\]: must be 80 bytes, is 79"):
        saved_session.read(bad, kv=kv, target=t, draft=d, n_vocab=100)
    assert kv.n_rows == 0 and not kv.target.k[0].any()  # the target's rows were not copied either
