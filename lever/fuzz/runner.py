"""The loader fuzzer: every input either loads or is refused with one LeverError line; nothing else.

Lever opens multi-GB GGUF files downloaded from anywhere, so every byte of a header is
untrusted. This runs inputs (seed files mutated by lever.fuzz.inputs, tiny models with faults
from lever.fuzz.models) through the two targets users reach with such a file: the loader
(GGUFFile, then Model without its layers, which checks the hyperparameters and every tensor
the architecture needs, then for a small file that opens a forward pass through the native
kernels) and the tokenizer (built from the same file, then encode, decode and streaming over
awkward text and out-of-range ids). A
success or a LeverError that is one line naming the file is fine; any other exception, a
LeverError without the file, a hang or a crash is a finding. `lever bench fuzz` runs many
inputs in a worker process (so hangs and crashes are caught) and writes each new finding to a
corpus directory; tests/fuzz/test_runner.py replays tests/fuzz_corpus/ with `check`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import attrs
import numpy as np

import lever
from lever.backends.cpu.kv_cache import causal_mask
from lever.errors import LeverError
from lever.fuzz import files
from lever.fuzz.inputs import Blob, Chooser, RandomChooser, Seed, chance, choice, load_seeds, mutate, seed_from_desc
from lever.fuzz.models import faulty_model, model_desc, nonfinite_model
from lever.gguf.file import GGUFFile
from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.model import finite
from lever.model.transformer import Model
from lever.outputs import atomic_write

TARGETS = ("loader", "tokenizer", "nonfinite", "config", "artifact", "cli")
# How often each family comes up: GGUF headers (loader and tokenizer) stay half of the inputs
FAMILIES = {"gguf": 50, "nonfinite": 14, "config": 12, "artifact": 12, "cli": 12}
FORWARD_MAX_BYTES = 8 << 20  # files up to this size that open are also run through a forward pass
ROOT = Path(__file__).resolve().parent.parent
_counter = itertools.count()  # input file names, unique within a process
SEED_FILES = [ROOT.parent / "shared" / "models" / "stories260K.gguf",
              ROOT.parent / "shared" / "models" / "llama-2-tiny-random.gguf",
              ROOT / "examples" / "models" / "stdlib-draft-q8_0.gguf",
              ROOT / "examples" / "models" / "stdlib-target-q4_0.gguf"]


@attrs.frozen
class Outcome:
    target: str
    status: str  # "ok", "refused" (a proper LeverError), "skipped" or "finding"
    signature: str = ""  # what went wrong and where, the same for every input hitting one bug
    detail: str = ""


# Lever's source folders (stages/ and backends/ sit beside lever/ in a source tree).
_PACKAGE = Path(lever.__file__).resolve().parent
_OURS = tuple(f"{d}{os.sep}" for d in (_PACKAGE, _PACKAGE.parent / "stages", _PACKAGE.parent / "backends"))


def _where(e: BaseException) -> str:
    """The innermost frame in Lever's own code: the same for every input hitting one bug."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if str(Path(f.filename).resolve()).startswith(_OURS)] or frames
    f = ours[-1] if ours else None
    return f"{Path(f.filename).name}:{f.lineno}" if f else "?"


def _run(target: str, fn, path: Path) -> tuple[Outcome, object]:
    try:
        return Outcome(target, "ok"), fn()
    except LeverError as e:
        msg = str(e)
        if "\n" in msg or str(path) not in msg:
            sig = f"{target}: LeverError not one line naming the file at {_where(e)}"
            return Outcome(target, "finding", sig, msg[:300]), None
        return Outcome(target, "refused", detail=msg[:300]), None
    except Exception as e:  # noqa: BLE001 -- everything else is what the fuzzer looks for
        sig = f"{target}: {type(e).__name__} at {_where(e)}"
        return Outcome(target, "finding", sig, f"{type(e).__name__}: {e}"[:300]), None


# --- inputs and what the tokenizer is asked to do with them ----------------------------------


def make_input(ch: Chooser, seeds: list[Seed]) -> Blob:
    """A GGUF: half mutated seeds, half tiny models with faults."""
    if seeds and chance(ch, 50):
        return mutate(ch, choice(ch, seeds), choice(ch, seeds) if chance(ch, 20) else None)
    return faulty_model(ch)


@attrs.define
class Sources:
    """What the families draw from, made once in the parent: GGUF seeds, configs, the files Lever
    reads back, the command table (from the CLI's parser, which lives a floor above)."""

    seeds: list[Seed]
    configs: list[str] = attrs.Factory(files.config_seeds)
    artifacts: list[files.Case] = attrs.Factory(list)
    commands: dict = attrs.Factory(dict)
    paths: list[str] = attrs.Factory(list)


def make_case(ch: Chooser, src: Sources, weights: dict[str, int] = FAMILIES) -> Blob | files.Case:
    """One input of a family drawn by its weight (families without sources are skipped)."""
    have = {"gguf": True, "nonfinite": True, "config": bool(src.configs), "artifact": bool(src.artifacts),
            "cli": bool(src.commands)}
    names = [f for f in weights if have[f] and weights[f] > 0]
    r = ch.int(0, sum(weights[f] for f in names) - 1)
    for family in names:
        r -= weights[family]
        if r < 0:
            break
    if family == "gguf":
        return make_input(ch, src.seeds)
    if family == "nonfinite":
        blob, tensor = nonfinite_model(ch)
        return files.Case("nonfinite", blob.prefix, ".gguf", json.dumps({"size": blob.size, "tensor": tensor}))
    if family == "config":
        return files.config_case(ch, src.configs)
    if family == "artifact":
        return files.mutate_file(ch, choice(ch, src.artifacts))
    return files.argv_case(ch, src.commands, src.paths)


PROBE_TEXTS = ["", " ", "Hello world", "  the then  ", "don't I'LL", "1234567", "你好 😀 e\u0301 \u00a0\u200b",
               "<s>a</s><unk>", "<|endoftext|>x<|im_start|>", "\x00\x7f\n\r\t", "\udcff\udc80 lone surrogates",
               "\u2581 <0x41>", "x" * 2000]


def probe(ch: Chooser, n_vocab: int) -> tuple[list[str], list[int]]:
    """Texts to encode and ids to decode; ids include every kind of out-of-range value."""
    alphabet = "ab th\u2581\n<>|/0x41sé你😀\udcff\x00"
    texts = PROBE_TEXTS + ["".join(choice(ch, alphabet) for _ in range(ch.int(0, 40))) for _ in range(2)]
    ids = [0, 1, n_vocab - 1, n_vocab, n_vocab + 1, -1, -n_vocab - 1, 2**31, 2**63, -(2**63)]
    ids += [ch.int(0, max(n_vocab - 1, 0)) for _ in range(8)]
    return texts, ids


# --- the targets ---------------------------------------------------------------------------------


def _forward(f) -> None:
    """A file that opens is run: every layer loaded and two tokens through the native kernels,
    so a shape the checks let through that the kernels cannot take shows up as a crash."""


    model = Model(file=f)
    n = min(2, model.spec.n_ctx_train)
    ids = np.array([0, model.spec.n_vocab - 1][:n])
    hidden = model.forward(ids, np.arange(n, dtype=np.int32), causal_mask(0, n), model.new_cache(n))
    model.logits(hidden)


def _exercise(tok, blob: Blob) -> None:
    ch = RandomChooser(random.Random(hashlib.sha256(blob.prefix).digest()))  # the same probe on every replay
    texts, ids = probe(ch, tok.vocab_size)
    for text in texts:
        got = tok.encode(text)
        tok.decode(got)
    for i in ids:
        for call in (lambda i=i: tok.decode([i]), lambda i=i: tok.token_bytes(i),
                     lambda i=i: StreamDecoder(tok).push(i)):
            try:
                call()
            except LeverError as e:  # an id out of range: refused, the rest goes on
                if str(tok._vocab.path) not in str(e) or "\n" in str(e):
                    raise RuntimeError(f"decode error without the file: {e}") from None
    stream = StreamDecoder(tok)
    for i in ids:
        if 0 <= i < tok.vocab_size:
            stream.push(i)
    stream.flush()


def check(item: Blob | files.Case, workdir: Path, stage=None, parser_factory=None) -> list[Outcome]:
    """One input through its targets, in this process. `stage` (a shared int) records which runs."""
    if isinstance(item, files.Case):
        return check_case(item, workdir, stage, parser_factory)
    blob = item
    path = workdir / f"in-{os.getpid()}-{next(_counter)}.gguf"
    blob.write(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow or NaN warnings mean a value went unchecked
        try:
            return _check(blob, path, stage)
        finally:
            path.unlink()  # a mapping still open stays valid: the file is never rewritten in place


def _check(blob: Blob, path: Path, stage) -> list[Outcome]:
    if stage is not None:
        stage.value = 0
    parsed, f = _run("loader", lambda: GGUFFile(path), path)
    if f is None:
        return [parsed, Outcome("tokenizer", "skipped")]
    loader, model = _run("loader", lambda: Model(file=f, load_layers=False), path)
    if model is not None and blob.size <= FORWARD_MAX_BYTES:
        loader, _ = _run("loader", lambda: _forward(f), path)
    if stage is not None:
        stage.value = 1
    tokenizer, _ = _run("tokenizer", lambda: _exercise(Tokenizer.from_gguf(f), blob), path)
    return [loader, tokenizer]


_parsers: dict = {}  # parser_factory -> its parser, built once per worker


def check_case(case: files.Case, workdir: Path, stage=None, parser_factory=None) -> list[Outcome]:
    """A non-GGUF input (lever.fuzz.files) or a GGUF with non-finite values through its target."""
    target = "artifact" if case.family.startswith("artifact") else case.family
    if stage is not None:
        stage.value = TARGETS.index(target)
    path = workdir / f"in-{os.getpid()}-{next(_counter)}{case.suffix}"
    if case.family == "nonfinite":
        meta = json.loads(case.extra)
        Blob(case.data, meta["size"]).write(path)
    elif case.family != "cli":
        path.write_bytes(case.data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            if case.family == "nonfinite":
                return [_run_case(target, lambda: _nonfinite(path, meta["tensor"]), path)]
            if case.family == "config":
                return [_run_case(target, lambda: files.check_config(case, path), path)]
            if case.family == "cli":
                if parser_factory not in _parsers:
                    _parsers[parser_factory] = parser_factory()
                return [_run_case(target, lambda: files.check_argv(case, _parsers[parser_factory]), None)]
            return [_run_case(target, lambda: files.check_file(case, path), path)]
        finally:
            path.unlink(missing_ok=True)


def _run_case(target: str, fn, path: Path | None) -> Outcome:
    """A family's check returns None (accepted) or the line it was refused with; a LeverError
    escaping it must name the file; anything else is a finding."""
    try:
        refused = fn()
        return Outcome(target, "ok") if refused is None else Outcome(target, "refused", detail=refused[:300])
    except files.NotOneLine as e:
        return Outcome(target, "finding", f"{target}: LeverError not one line naming the file at {_where(e)}",
                       str(e)[:300])
    except LeverError as e:
        msg = str(e)
        if "\n" in msg or (path is not None and str(path) not in msg):
            return Outcome(target, "finding", f"{target}: LeverError not one line naming the file at {_where(e)}",
                           msg[:300])
        return Outcome(target, "refused", detail=msg[:300])
    except Exception as e:  # noqa: BLE001 -- everything else is what the fuzzer looks for
        return Outcome(target, "finding", f"{target}: {type(e).__name__} at {_where(e)}",
                       f"{type(e).__name__}: {e}"[:300])


def _nonfinite(path: Path, tensor: str) -> str | None:
    """A model with NaN or Inf in `tensor`: the scan must list exactly that tensor; a forward must
    stop with one line naming the file or give finite logits (the values were never read)."""
    f = GGUFFile(path)
    listed = [name for name, _, _ in finite.scan(f)]
    if listed != [tensor]:
        raise RuntimeError(f"the scan listed {listed}, the poisoned tensor is {tensor}")
    model = Model(file=f)
    n = min(2, model.spec.n_ctx_train)
    ids = np.array([0, model.spec.n_vocab - 1][:n])
    hidden = model.forward(ids, np.arange(n, dtype=np.int32), causal_mask(0, n), model.new_cache(n))
    logits = model.logits(hidden)
    model.check_logits(logits)
    if not np.isfinite(logits).all():
        raise RuntimeError("non-finite logits passed check_logits")
    return None


def check_bytes(data: bytes, workdir: Path) -> list[Outcome]:
    return check(Blob.of(data), workdir)


def default_seeds() -> list[Seed]:
    """The shipped and shared real files (when present, vocabularies cut to 1024 tokens), and a
    clean tiny model of each kind the generator makes: qwen2, qwen3 and llama, BPE and SentencePiece."""
    seeds = load_seeds(SEED_FILES)
    for i, (arch, vocab) in enumerate((("qwen2", "gpt2"), ("qwen3", "gpt2"), ("llama", "llama"), ("llama", "gpt2"))):
        seeds.append(seed_from_desc(f"tiny-{arch}-{vocab}", model_desc(RandomChooser(random.Random(i)), arch, vocab)))
    return seeds


# --- corpus files: gzip keeps a seed's zero-filled tensor data to a few KB -------------------


def corpus_name(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16] + ".gguf.gz"


def save_finding(corpus: Path, blob: Blob | files.Case, outcome: Outcome) -> Path:
    corpus.mkdir(parents=True, exist_ok=True)
    if isinstance(blob, files.Case):  # kept as JSON, named by family: replayed with files.read_case
        data = files.dump_case(blob)
        path = corpus / (hashlib.sha256(data).hexdigest()[:16] + f".{blob.family}.json.gz")
    else:
        data = blob.materialize()
        path = corpus / corpus_name(data)
    with atomic_write(path, "wb", "finding") as f:  # a fresh temp name, renamed: no planted link is followed
        f.write(gzip.compress(data, mtime=0))
    log_fd = os.open(corpus / "findings.tsv", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with open(log_fd, "a") as log:
        log.write(f"{path.name}\t{outcome.signature}\t{outcome.detail.replace(chr(9), ' ').replace(chr(10), ' ')}\n")
    return path


def read_corpus_file(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.name.endswith(".gz") else data


# --- the worker: inputs run in a child so a hang or a crash is seen, not suffered ----------------


def _worker(conn, stage, mem_limit: int, fn, workdir: Path) -> None:
    if mem_limit:  # a huge allocation fails here (MemoryError, a finding) instead of taking the machine
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    while (item := conn.recv()) is not None:
        conn.send(fn(item, workdir, stage))


class Worker:
    """A child process running `fn` (check, by default) on one input at a time; a hang or a
    crash becomes a finding and the next input gets a fresh child."""

    def __init__(self, mem_limit: int, fn=check):
        self.ctx, self.mem_limit, self.fn = mp.get_context("spawn"), mem_limit, fn
        self.proc = None
        # in memory where there is a tmpfs; the parent removes what a crashed child left
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.workdir = Path(tempfile.mkdtemp(prefix="lever-fuzz-", dir=shm))

    def start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.stage = self.ctx.Value("i", 0, lock=False)
        self.proc = self.ctx.Process(target=_worker, args=(child, self.stage, self.mem_limit, self.fn, self.workdir),
                                     daemon=True)
        self.proc.start()
        child.close()

    def run(self, blob: Blob | files.Case, timeout: float) -> list[Outcome]:
        if self.proc is None:
            self.start()
        try:
            self.conn.send(blob)
            if self.conn.poll(timeout):
                return self.conn.recv()
            what = "hang", f"no answer within {timeout:g} s"
        except (EOFError, ConnectionError):
            self.proc.join(5)
            what = "crash", f"worker exited with code {self.proc.exitcode}"
        target = TARGETS[self.stage.value] if 0 <= self.stage.value < len(TARGETS) else "loader"
        self.stop()
        return [Outcome(target, "finding", f"{target}: {what[0]}", what[1])]

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                try:
                    self.conn.send(None)
                    self.proc.join(2)
                except OSError:
                    pass
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self.conn.close()
            self.proc = None


@attrs.define
class FuzzReport:
    n: int = 0
    seconds: float = 0.0
    counts: Counter = attrs.Factory(Counter)  # (target, status) -> inputs
    findings: Counter = attrs.Factory(Counter)  # signature -> inputs
    saved: list[Path] = attrs.Factory(list)

    @property
    def rate(self) -> float:
        return self.n / self.seconds if self.seconds else 0.0

    def lines(self) -> list[str]:
        out = [f"fuzz: {self.n} inputs in {self.seconds:.1f} s ({self.rate:.0f} inputs/s)"]
        for t in TARGETS:
            c = {s: self.counts[(t, s)] for s in ("ok", "refused", "finding", "skipped")}
            out.append(f"  {t:<10} {c['ok'] + c['refused'] + c['finding']:>7} run: {c['ok']} accepted, "
                       f"{c['refused']} refused with a LeverError, {c['finding']} findings"
                       + (f" ({c['skipped']} not run: the file did not parse)" if c["skipped"] else ""))
        n_bad = sum(self.findings.values())
        out.append(f"  findings: {len(self.findings)} distinct, {n_bad} inputs" + (":" if self.findings else ""))
        out += [f"    {n:>6} x {sig}" for sig, n in self.findings.most_common()]
        if self.saved:
            out.append(f"  corpus: {len(self.saved)} new files in {self.saved[0].parent}")
        return out


def run_fuzz(n: int, seed: int = 0, corpus: Path | None = None, timeout: float = 5.0, per_signature: int = 1,
             mem_limit: int = 4 << 30, seeds: list[Seed] | None = None, progress=None, parser_factory=None,
             families: dict[str, int] | None = None) -> FuzzReport:
    """n inputs through their targets; each new finding's input is saved to `corpus` (at most
    `per_signature` per distinct signature). `parser_factory` (lever.cli.main.build_parser)
    enables the command-line family; `families` overrides FAMILIES' weights."""
    rng = random.Random(seed)
    ch = RandomChooser(rng)
    seeds = default_seeds() if seeds is None else seeds
    report = FuzzReport()
    with tempfile.TemporaryDirectory(prefix="lever-fuzz-seeds-") as tmp:
        src = Sources(seeds, artifacts=files.artifact_seeds(Path(tmp)))
        if parser_factory is not None:
            src.commands = files.commands(parser_factory())
            src.paths = files.argv_paths(Path(tmp))
        weights = families if families is not None else FAMILIES
        worker = Worker(mem_limit, functools.partial(check, parser_factory=parser_factory))
        t0 = time.perf_counter()
        try:
            for i in range(n):
                item = make_case(ch, src, weights)
                for o in worker.run(item, timeout):
                    report.counts[(o.target, o.status)] += 1
                    if o.status == "finding":
                        report.findings[o.signature] += 1
                        if corpus is not None and report.findings[o.signature] <= per_signature:
                            report.saved.append(save_finding(corpus, item, o))
                report.n, report.seconds = i + 1, time.perf_counter() - t0
                if progress is not None:
                    progress(report)
        finally:
            worker.close()
            report.seconds = time.perf_counter() - t0
    return report


def replay(paths: list[Path], workdir: Path | None = None) -> dict[Path, list[Outcome]]:
    """Each corpus file through both targets, in this process."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in paths:
            out[p] = check_bytes(read_corpus_file(p), Path(workdir or tmp))
    return out
