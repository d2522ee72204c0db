"""The fuzzer's inputs besides GGUF headers (lever.fuzz.runner): configs with their --set
overrides, the files Lever writes and reads back (profiles, predictor artifacts, saved
sessions), and command-line argument vectors.

Each family is a generator (a Chooser's decisions -> a `Case`: the bytes of the input and
what goes with it) and a check that runs it through what a user reaches with it: `load_config`,
the file kind's checked reader, the command's parser and argument checks. As for GGUFs, an
input either passes or is refused with one LeverError line naming the file (or --set, or the
flag); anything else is a finding. Nothing here runs a model: a case takes milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import attrs

from lever.fuzz.inputs import FLOATS, INTS, Chooser, chance, choice

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples"


@attrs.frozen
class Case:
    """One input of a family: `data` is written to a file named with `suffix`; `extra` is
    what goes with it (JSON: a config's overrides, a command's argument vector)."""

    family: str
    data: bytes
    suffix: str = ""
    extra: str = ""


# --- values a user might type or a file might hold ------------------------------------------------

WORDS = ["", " ", "x", "nope", "auto", "cpu", "qnn", "speculative", "flash-ar", "chain", "mmap", "direct",
         "0", "-1", "1e9", "nan", "inf", "true", "[]", "{}", "\"", "'", "\\", "\n", "a\nb", "é", "\x00", "../",
         "/dev/null", "/", "/nonexistent/x.gguf", "64MiB", "1.5GB", "-3MiB", "9999999TiB", "25%", "0.25"]


def toml_value(ch: Chooser) -> str:
    """A TOML value of any type, or text that is not one."""
    k = ch.int(0, 9)
    if k <= 2:
        return str(choice(ch, INTS))
    if k <= 4:
        f = choice(ch, FLOATS)
        return "nan" if math.isnan(f) else ("inf" if f == math.inf else "-inf" if f == -math.inf else repr(f))
    if k <= 6:
        return json.dumps(choice(ch, WORDS))
    if k == 7:
        return choice(ch, ["true", "false", "[]", "[1, 2]", '["a"]', "{}", "{a = 1}", "[[1], [2]]"])
    return choice(ch, WORDS)  # bare: often not TOML at all


# --- configs and overrides --------------------------------------------------------------------------


def config_seeds() -> list[str]:
    return [p.read_text() for p in sorted(EXAMPLES.glob("*.toml"))]


def _keys(text: str) -> list[tuple[str, str]]:
    """(section, key) of each assignment in a config's text."""
    out, section = [], ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            section = s.strip("[]").strip()
        elif "=" in s and not s.startswith("#") and section:
            out.append((section, s.split("=", 1)[0].strip()))
    return out


def mutate_config(ch: Chooser, text: str) -> bytes:
    lines = text.splitlines()
    for _ in range(ch.int(1, 4)):
        if not lines:
            break
        i = ch.int(0, len(lines) - 1)
        k = ch.int(0, 9)
        if k <= 3 and "=" in lines[i]:  # a value of another type or out of range
            lines[i] = lines[i].split("=", 1)[0] + "= " + toml_value(ch)
        elif k == 4:
            del lines[i]
        elif k == 5:
            lines.insert(i, lines[ch.int(0, len(lines) - 1)])  # a duplicated key or section
        elif k == 6 and "=" in lines[i]:  # a typo in a key
            key, value = lines[i].split("=", 1)
            lines[i] = key.strip() + choice(ch, ["s", "_", "X", ""]) + " =" + value
        elif k == 7:
            lines.insert(i, choice(ch, ["[nope]", "[model", "[[model]]", "x = 1", "model = 3", "= 1", "[]"]))
        else:
            cut = ch.int(0, len(lines[i]))
            lines[i] = lines[i][:cut]
    data = "\n".join(lines).encode()
    if chance(ch, 3):
        data = data[: ch.int(0, len(data))] + bytes([ch.int(128, 255)]) + data[ch.int(0, len(data)):]  # not UTF-8
    return data


def override(ch: Chooser, keys: list[tuple[str, str]]) -> str:
    k = ch.int(0, 9)
    if k <= 5 and keys:
        section, key = choice(ch, keys)
        return f"{section}.{key}={toml_value(ch)}"
    if k == 6:
        return choice(ch, ["", "=", "generate", "generate.=1", ".x=1", "a.b.c=1", "generate.top_k", "nope.x=1"])
    if k == 7 and keys:  # two values smuggled through one --set
        (s1, k1), (s2, k2) = choice(ch, keys), choice(ch, keys)
        return f"{s1}.{k1}={toml_value(ch)}\n{s2}.{k2}={toml_value(ch)}"
    if k == 8 and keys:
        section, key = choice(ch, keys)
        return f'{section}.{key}="unclosed'
    return choice(ch, WORDS)


def config_case(ch: Chooser, seeds: list[str]) -> Case:
    text = choice(ch, seeds)
    keys = _keys(text)
    data = mutate_config(ch, text) if chance(ch, 80) else text.encode()
    sets = [override(ch, keys) for _ in range(ch.int(0, 3))]
    return Case("config", data, ".toml", json.dumps(sets))


def check_config(case: Case, path: Path) -> str | None:
    """None when the config loads; else the one line it was refused with (LeverError)."""
    from lever.config import load_config
    from lever.errors import LeverError

    sets = json.loads(case.extra)
    try:
        load_config(path, sets)
        return None
    except LeverError as e:
        msg = str(e)
        if "\n" in msg or (str(path) not in msg and "--set" not in msg):
            raise NotOneLine(msg) from None
        return msg


class NotOneLine(Exception):
    """A LeverError that is not one line naming its file (or --set, or flag): a finding."""


# --- command lines ----------------------------------------------------------------------------------

FLAG_VALUES = ["0", "1", "-1", "-2", "-5", "2", "7", "64", "1e3", "0.5", "-0.5", "1.5", "nan", "inf", "-inf",
               "99999999999999999999999", "-99999999999999999999999", "2147483648", "9223372036854775808", "",
               " ", "x", "1,2,3", "0,99999999999", "1,,2", "-", "/nonexistent", "/dev/null", "/", "65536", "0x10"]


def commands(parser) -> dict[str, list]:
    """Each leaf command (`run`, `bench model`, ...) and the options it takes."""
    import argparse

    out = {}

    def walk(p, prefix):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[" ".join(prefix)] = [a for a in p._actions if a.option_strings and a.dest not in ("help", "debug")]
            return
        for name, sp in subs[0].choices.items():
            walk(sp, [*prefix, name])

    walk(parser, [])
    return out


def argv_paths(workdir: Path) -> list[str]:
    """Paths for the command lines: real inputs, a GGUF where text goes, missing files and
    folders, a directory, a FIFO, a device, and outputs in folders that exist or do not."""
    import os

    fifo = workdir / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    return [str(EXAMPLES / "default.toml"), str(EXAMPLES / "models" / "stdlib-draft-q8_0.gguf"), str(fifo),
            str(workdir), "/dev/null", "/dev/zero", str(workdir / "missing.gguf"), str(workdir / "nodir" / "out.npy"),
            str(workdir / "out.npy"), str(workdir / "out.json"), str(EXAMPLES / "prompts" / "code.txt"), ""]


def dump_case(case: Case) -> bytes:
    import base64

    return json.dumps({"family": case.family, "data": base64.b64encode(case.data).decode(), "suffix": case.suffix,
                       "extra": case.extra}).encode()


def read_case(data: bytes) -> Case:
    import base64

    d = json.loads(data)
    return Case(d["family"], base64.b64decode(d["data"]), d["suffix"], d["extra"])


def argv_case(ch: Chooser, table: dict[str, list], paths: list[str]) -> Case:
    """A command with a few of its options, each with a value from the pool; the positional
    arguments (convert's files, inspect's model) from real, missing and odd paths."""
    name = choice(ch, sorted(table))
    argv = name.split()
    for action in [choice(ch, table[name]) for _ in range(ch.int(0, 4))] if table[name] else []:
        argv.append(choice(ch, action.option_strings))
        if action.nargs != 0:
            pool = paths if chance(ch, 30) else FLAG_VALUES
            argv.append(choice(ch, pool))
    if name in ("convert",):
        argv += [choice(ch, paths), choice(ch, paths)]
    elif name in ("inspect",):
        argv.append(choice(ch, paths))
    return Case("cli", b"", "", json.dumps(argv))


def check_argv(case: Case, parser) -> str | None:
    """The vector through argparse and the command's own argument checks (`args.check`, set
    by each command's parser), never its work. The parser comes from lever.cli (a floor above)."""
    from lever.errors import LeverError

    argv = json.loads(case.extra)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, 2):
            raise RuntimeError(f"argparse exit {e.code}") from None
        lines = [x for x in err.getvalue().splitlines() if x.startswith("lever")]
        return lines[-1] if lines else "usage"
    try:
        if getattr(args, "check", None) is not None:
            args.check(args)
        return None
    except LeverError as e:
        msg = str(e)
        if "\n" in msg:
            raise NotOneLine(msg) from None
        return msg


# --- files Lever writes and reads back ------------------------------------------------------------

ODD_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.5, -0.0, math.nan, math.inf,
              -math.inf, 1e308, -1e308, 1e-308, "", "x", "é\n\x00", b"", b"\x00" * 3, [], [1], [[]], {}, {"a": 1}]


def artifact_seeds(workdir: Path) -> list[Case]:
    """A valid file of each kind, written by Lever's own writers, with what its reader needs
    (a model file the artifact belongs to) in `workdir`, which outlives the run's workers."""
    import types

    import numpy as np

    from lever.backends.cpu.kv_cache import KVCache
    from lever.gguf.identity import ModelIdentity
    from lever.pipelines import saved_session
    from lever.pipelines.compose import KVState
    from lever.policy import profile as profiles
    from lever.policy.acceptance import AcceptanceTable
    from lever.policy.predictor import Artifact, Correction
    from lever.policy.profile import HEAD_ROWS, TOKEN_BUCKETS, DraftProfile, FlashProfile, Profile, TargetProfile

    model = workdir / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(5000))
    ident = ModelIdentity.of(model)
    n = len(TOKEN_BUCKETS)
    fl = FlashProfile(mode="direct", queue_depth=4, chunk_bytes=1 << 20, bandwidth_cap_bytes_per_s=0.0,
                      read_latency_ms=0.0, pass_bytes=10 << 20, read_bytes_per_s=2e9, small_read_s=1e-4,
                      chunk_read_s=5e-4, device_read_bytes_per_s=2e9, device_small_read_s=1e-4)
    t = TargetProfile(model=ident, n_layer=4, kv_rows=256, tokens=TOKEN_BUCKETS,
                      layer_s=tuple(1e-3 * (i + 1) for i in range(n)),
                      resident_layer_s=tuple(5e-4 * (i + 1) for i in range(n)), layers_timed=(0, 2),
                      head_rows=HEAD_ROWS, head_s=(1e-4, 2e-4, 1e-3))
    d = DraftProfile(ident, 2, 256, TOKEN_BUCKETS, tuple(1e-3 for _ in range(n)), HEAD_ROWS, (1e-5, 2e-5, 1e-4))
    profile = Profile(device="cpu", platform="linux", threads=2, date="2026-01-01T00:00:00Z", method="fuzz",
                      lever_version="0", flash=fl, target=t, draft=d, load_avg_1min=(0.5, 0.7))
    cases = [Case("artifact-profile", profiles.write(profile, workdir / "p.msgpack").read_bytes(), ".msgpack")]
    cal = AcceptanceTable()
    for q, rank, ok in ((0.9, 0, True), (0.3, 1, False), (0.6, 0, True)):
        cal.observe(q, rank, ok)
    Artifact(ident, "cd" * 32, 1, 0.1, Correction(2.0, 0.5, -1.0), cal, {"x": 1}).write(workdir / "a.msgpack")
    cases.append(Case("artifact-predictor", (workdir / "a.msgpack").read_bytes(), ".msgpack",
                      json.dumps({"model": str(model), "n_layer": 4})))
    spec = types.SimpleNamespace(n_layer=2, n_head_kv=2, head_dim=4)
    kv = KVState(KVCache(spec, 16), KVCache(spec, 16), 5)
    rng = np.random.default_rng(0)
    for cache in (kv.target, kv.draft):
        for a in cache.k + cache.v:
            a[:5] = rng.standard_normal(a[:5].shape)
    saved_session.write(workdir / "s.msgpack", messages=[{"role": "user", "content": "hi"}], ids=[1, 2, 3, 4, 5],
                        kv=kv, target=ident, draft=ident)
    cases.append(Case("artifact-session", (workdir / "s.msgpack").read_bytes(), ".msgpack",
                      json.dumps({"model": str(model)})))
    return cases


def paths_in(doc, prefix=()):
    """Every (path, value) inside a decoded document (tests/policy/test_fields.py mutates by it too)."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths_in(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths_in(v, (*prefix, i))


def _mutate_doc(ch: Chooser, doc):
    for _ in range(ch.int(1, 3)):
        paths = list(paths_in(doc))
        path, value = choice(ch, paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        op = ch.int(0, 5)
        if not path:
            doc = choice(ch, ODD_VALUES)
        elif op == 0:
            del parent[path[-1]]
        elif op == 1 and isinstance(value, list):  # another length
            parent[path[-1]] = value[:-1] if value and chance(ch, 50) else value + value[-1:] + [0]
        elif op == 2 and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[path[-1]] = choice(ch, [-value, value + 1, 0, -1, math.nan, math.inf, 2**63 - 1, value * 1e300])
        else:
            parent[path[-1]] = choice(ch, ODD_VALUES)
        if not isinstance(doc, (dict, list)):
            break
    return doc


def mutate_file(ch: Chooser, seed: Case) -> Case:
    """A type or number changed, a key deleted, a list made longer or shorter; or the bytes
    themselves cut, flipped or replaced."""
    import msgpack

    raw = seed.data
    k = ch.int(0, 9)
    if k == 0:
        data = raw[: ch.int(0, len(raw))]
    elif k == 1:
        b = bytearray(raw)
        for _ in range(ch.int(1, 8)):
            b[ch.int(0, len(b) - 1)] = ch.int(0, 255)
        data = bytes(b)
    elif k == 2:
        data = choice(ch, [b"", b'{"format": 1}', b"\xc1", bytes(ch.int(0, 255) for _ in range(64)), raw + b"\x00"])
    else:
        doc = _mutate_doc(ch, msgpack.unpackb(raw, raw=False))
        try:
            data = msgpack.packb(doc, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):  # past what msgpack can hold: no file can hold it either
            data = raw
    return attrs.evolve(seed, data=data)


def check_file(case: Case, path: Path) -> str | None:
    """The file through its kind's checked reader, then used as a run would use it."""
    import numpy as np

    from lever.errors import LeverError

    meta = json.loads(case.extra or "{}")
    try:
        if case.family == "artifact-profile":
            from lever.policy import profile as profiles
            from lever.policy.cost_model import CostModel

            p = profiles.read(path)
            cm = CostModel.from_profile(p, [1 << 20] * p.target.n_layer)
            for n in (1, 7, 64, 300):
                draft_s = cm.draft_s(n) if p.draft is not None else 1e-3
                if not (math.isfinite(cm.verify_s(n)) and math.isfinite(cm.cycle_s(n, draft_s, n))):
                    raise RuntimeError(f"a profile read back prices {n} nodes at a non-finite time")
        elif case.family == "artifact-predictor":
            from lever.policy.predictor import Artifact, scores

            a = Artifact.read(path, meta["model"], n_layer=meta["n_layer"])
            for q in (0.0, 0.3, 1.0):
                for rank in (0, 1, 3):
                    if not 0 <= a.acceptance(q, rank) <= 1:
                        raise RuntimeError(f"acceptance({q}, {rank}) = {a.acceptance(q, rank)} read back")
            s = scores(np.array([30.0, -5.0, 0.0]), np.array([0.9, 0.05, 1e-12]), a.correction)
            if not np.isfinite(s).all():
                raise RuntimeError("an artifact read back gives non-finite scores")
        else:
            import types

            from lever.backends.cpu.kv_cache import KVCache
            from lever.gguf.identity import ModelIdentity
            from lever.pipelines import saved_session
            from lever.pipelines.compose import KVState

            ident = ModelIdentity.of(meta["model"])
            saved_session.load(path)
            spec = types.SimpleNamespace(n_layer=2, n_head_kv=2, head_dim=4)
            kv = KVState(KVCache(spec, 16), KVCache(spec, 16), 0)
            saved_session.read(path, kv=kv, target=ident, draft=ident, n_vocab=100)
            if not 0 <= kv.n_rows <= 16:
                raise RuntimeError(f"a session read back fills {kv.n_rows} rows of 16")
        return None
    except LeverError as e:
        msg = str(e)
        if "\n" in msg or not msg.startswith(f"{path}: "):
            raise NotOneLine(msg) from None
        return msg
