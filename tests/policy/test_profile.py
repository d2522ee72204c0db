"""`lever profile`: measuring a tiny model pair, the msgpack file, its errors, config and CLI.

Timings on this shared machine are noise, so nothing here asserts a speed: only the profile's
structure, that it survives msgpack unchanged, and one-line errors naming the file.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib

import msgpack
import pytest

from lever.backends.flash import FlashConfig, FlashStore
from lever.cli.profile import add_parser as add_profile_parser
from lever.cli.profile import measure
from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.identity import ModelIdentity
from lever.policy.profile import HEAD_ROWS, KV_ROWS, TOKEN_BUCKETS, Profile, default_path, read, write

FAST = {"rounds": 1, "passes": 1, "n_reads": 4}  # structure, not precision


@pytest.fixture(scope="module")
def pair(tiny_model):
    return tiny_model("qwen2", "Q4_0", n_layer=4), tiny_model("qwen2", "Q8_0", n_layer=2, seed=3)


def config(target, draft=None, *sets: str):
    overrides = [f"model.target='{target}'", "flash.mode='mmap'"]  # mmap: works on tmpfs too
    if draft:
        overrides.append(f"model.draft='{draft}'")
    return load_config(None, overrides + list(sets))


@pytest.fixture(scope="module")
def profiled(pair) -> Profile:
    return measure(config(*pair), **FAST)


def test_profile_round_trips_through_msgpack(profiled, tmp_path):
    path = write(profiled, tmp_path / "p.msgpack")
    assert read(path) == profiled
    raw = msgpack.unpackb(path.read_bytes())
    assert raw["format"] == "lever-profile" and raw["version"] == 2
    assert not (tmp_path / "p.msgpack.tmp").exists()


def test_profile_records_machine_method_and_models(profiled, pair):
    p = profiled
    assert p.device and p.platform and p.method and p.lever_version and p.threads >= 1
    assert datetime.datetime.fromisoformat(p.date).tzinfo is not None
    head = pair[0].read_bytes()[: 2**20]
    assert p.target.model == ModelIdentity(str(pair[0]), pair[0].stat().st_size, hashlib.sha256(head).hexdigest())
    assert p.draft.model.same_file(ModelIdentity.of(pair[1]))


def test_compute_tables_cover_every_bucket(profiled):
    t, d = profiled.target, profiled.draft
    assert t.tokens == TOKEN_BUCKETS and len(t.layer_s) == len(TOKEN_BUCKETS) == len(t.resident_layer_s)
    assert t.head_rows == HEAD_ROWS and len(t.head_s) == len(HEAD_ROWS)
    assert t.n_layer == 4 and t.kv_rows == KV_ROWS and set(t.layers_timed) <= set(range(4)) and t.layers_timed
    assert d.batch == TOKEN_BUCKETS and len(d.forward_s) == len(TOKEN_BUCKETS) and d.n_layer == 2
    assert all(s > 0 for s in t.layer_s + t.resident_layer_s + t.head_s + d.forward_s + d.head_s)


def test_flash_section_mirrors_the_config_and_streams_every_layer(profiled, pair):
    fl = profiled.flash
    cfg = FlashConfig(mode="mmap")
    assert (fl.mode, fl.queue_depth, fl.chunk_bytes, fl.bandwidth_cap_bytes_per_s, fl.read_latency_ms) == \
        (cfg.mode, cfg.queue_depth, cfg.chunk_bytes, 0.0, 0.0)
    with FlashStore(pair[0], cfg) as store:
        assert fl.pass_bytes == store.streamed_bytes  # measured at dram_budget 0 whatever the config says
    assert fl.read_bytes_per_s > 0 and fl.small_read_s > 0 and fl.chunk_read_s > 0
    # No emulation configured: the device figures are the configured ones.
    assert (fl.device_read_bytes_per_s, fl.device_small_read_s) == (fl.read_bytes_per_s, fl.small_read_s)


@pytest.mark.parametrize("mode", ["direct", "mmap"])
def test_emulated_flash_is_measured_with_and_without_the_emulation(pair, mode):
    cfg = config(pair[0], None, f"flash.mode='{mode}'", "flash.read_latency_ms=2", "flash.dram_budget='50%'")
    try:
        p = measure(cfg, **FAST)
    except LeverError as e:
        if "O_DIRECT" in str(e):
            pytest.skip(str(e))
        raise
    assert p.draft is None and p.flash.mode == mode and p.flash.read_latency_ms == 2.0
    # The emulated latency is a sleep, a floor the configured figure cannot go under.
    assert p.flash.small_read_s >= 2e-3 and p.flash.device_small_read_s > 0
    assert p.flash.device_read_bytes_per_s > 0


def test_missing_or_corrupt_profile_is_one_line_error_naming_the_file(profiled, tmp_path):
    missing = tmp_path / "none.msgpack"
    with pytest.raises(LeverError, match=rf"{missing}: no such profile file"):
        read(missing)
    good = write(profiled, tmp_path / "good.msgpack").read_bytes()
    bad = {
        "garbage": b"\xc1\xc1\xc1 not msgpack",
        "truncated": good[: len(good) // 2],
        "other": msgpack.packb({"format": "something-else"}),
        "old": msgpack.packb({"format": "lever-profile", "version": 99, "profile": {}}),
        "fields": msgpack.packb({"format": "lever-profile", "version": 2, "profile": {"device": "x"}}),
        "stale": msgpack.packb({"format": "lever-profile", "version": 1, "profile": {}}),  # before tiles: re-profile
        "types": good.replace(b"\xa7layer_s", b"\xa7layer_x"),
    }
    for name, data in bad.items():
        path = tmp_path / f"{name}.msgpack"
        path.write_bytes(data)
        with pytest.raises(LeverError) as e:
            read(path)
        msg = str(e.value)
        assert msg.startswith(f"{path}: ") and "\n" not in msg, (name, msg)


def test_profile_section_in_configs(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[profile]\npath = "machine.msgpack"\n')
    cfg = load_config(toml)
    assert cfg.profile.path == str(tmp_path / "machine.msgpack")
    assert load_config(None).profile.path == ""  # default: no profile, the cost model's fallback
    toml.write_text('[profile]\nfile = "x"\n')
    with pytest.raises(LeverError, match=r"\[profile\] unknown key 'file'"):
        load_config(toml)


def test_measure_needs_the_models(tmp_path):
    with pytest.raises(LeverError, match="target is not set"):
        measure(load_config(None), **FAST)
    with pytest.raises(LeverError, match=rf"{tmp_path / 'absent.gguf'}: no such model file"):
        measure(config(tmp_path / "absent.gguf"), **FAST)


def profile_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="lever")
    add_profile_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", *argv, "--rounds", "1", "--passes", "1"])
    return args.func(args)


def test_cli_writes_next_to_the_target_and_prints_a_table(pair, tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text(f'[model]\ntarget = "{pair[0]}"\n\n[flash]\nmode = "mmap"\n')
    assert profile_cli("-c", str(toml), "--set", f"model.draft='{pair[1]}'") == 0
    out = capsys.readouterr().out
    assert "target layer ms" in out and "draft forward ms" in out and "verify ms" in out
    p = read(default_path(pair[0]))
    assert str(default_path(pair[0])) == f"{pair[0]}.lever-profile.msgpack"
    assert p.draft is not None and p.target.model.same_file(ModelIdentity.of(pair[0]))
    default_path(pair[0]).unlink()

    assert profile_cli("-c", str(toml), "--out", str(tmp_path / "here.msgpack")) == 0
    assert read(tmp_path / "here.msgpack").draft is None
