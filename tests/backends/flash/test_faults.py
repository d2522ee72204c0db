"""Flash faults end to end: a run on the shipped pair meets a device or file fault mid-stream.

Each fault is made by `lever.backends.flash.faults` at the store's syscalls, at a chosen read
number, while `run_pipeline` streams the target (Flash-AR and Lever). A fault either ends the
run within a second with one LeverError naming the file, the layer and the offset, no
RunResult, and every thread, descriptor and staging buffer of the run released - or, where
retrying or waiting is right (a transient EIO, a partial transfer, a latency spike, a file
renamed over the one open), the run completes with the tokens of a run without faults.
"""

from __future__ import annotations

import gc
import re
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import psutil
import pytest

from lever.backends.flash import Faults, FlashConfig, FlashStore, inject
from lever.config import load_config
from lever.errors import LeverError
from lever.pipelines.engine import run_pipeline
from tests.backends.flash.files import disk_dir  # noqa: F401 (a fixture
from tests.conftest import ROOT
from tests.load import within

MODELS = ROOT / "examples" / "models"
TARGET, DRAFT = "stdlib-target-q4_0.gguf", "stdlib-draft-q8_0.gguf"
PROMPT = "def read_config(path):\n"
KINDS = ["flash-ar", "speculative"]  # speculative: default.toml's Lever (gain-cost trees)
# 6 layers, one resident (25%): reads 0-3 fill it at open; with 256 KiB chunks each pass then
# makes 20 reads (5 streamed layers x 4 chunks). Read 10 is in the prefill pass, 30 in decoding.
PREFILL_READ, DECODE_READ = 10, 30


def config(target: Path, kind: str, *sets: str):
    return load_config(ROOT / "examples" / "default.toml", [
        f'model.target="{target}"', f'model.draft="{target.parent / DRAFT}"', f'pipeline.kind="{kind}"',
        'pipeline.baseline=""', "generate.n_predict=12", "flash.chunk_bytes=262144", *sets])


@pytest.fixture(scope="module")
def pair_dir(disk_dir) -> Path:  # noqa: F811
    d = disk_dir / "faults-pair"
    d.mkdir(exist_ok=True)
    shutil.copyfile(MODELS / DRAFT, d / DRAFT)
    shutil.copyfile(MODELS / TARGET, d / TARGET)
    return d


@pytest.fixture(scope="module")
def reference(pair_dir) -> dict[str, list[int]]:
    """Tokens of fault-free runs; also starts the kernels' thread pool before any baseline."""
    return {kind: run_pipeline(config(pair_dir / TARGET, kind), PROMPT).tokens for kind in KINDS}


@pytest.fixture
def target(pair_dir, reference, request) -> Path:
    """A private copy of the target: some faults truncate or rewrite it."""
    path = pair_dir / f"target-{request.node.name}.gguf".replace("[", "-").replace("]", "")
    shutil.copyfile(pair_dir / TARGET, path)
    yield path
    path.unlink(missing_ok=True)


def settled(check, timeout_s: float = 30.0) -> bool:
    """check() within timeout_s: worker threads end just after the run does (on a loaded machine
    that may take a while; an idle one returns at once)."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


class Released:
    """What a run holds, taken before it; `check` after it says all of it was given back."""

    def __init__(self):
        self.proc = psutil.Process()
        self.threads, self.py_threads, self.fds = self.proc.num_threads(), threading.active_count(), self.proc.num_fds()

    def check(self, faults: Faults) -> None:
        """Call with no reference left to the run's exception (it holds the run's frames)."""
        [store] = faults.stores
        assert store.reader.closed, "the store's file is still open"
        pool = store.pool
        assert pool.n_free == pool.n_buffers, f"{pool.n_buffers - pool.n_free} staging buffers never given back"
        mapped = [weakref.ref(b._mem) for b in pool._all]
        faults.stores.clear()
        del store, pool
        assert settled(lambda: threading.active_count() <= self.py_threads), \
            f"threads left: {[t.name for t in threading.enumerate()]}"
        assert settled(lambda: self.proc.num_threads() <= self.threads)
        gc.collect()  # the run's objects are in reference cycles (stages, channels, tasks)
        assert all(m() is None for m in mapped), "staging buffers still mapped"
        assert self.proc.num_fds() <= self.fds, f"descriptors left: {self.proc.open_files()}"


def fails(cfg, faults: Faults) -> tuple[str, float]:
    """Runs into a fault: (the error's one line, seconds from the fault to the caller)."""
    released = Released()
    with inject(faults), pytest.raises(LeverError) as info:
        run_pipeline(cfg, PROMPT)
    stop_s = time.monotonic() - faults.fired[0][2]
    msg = str(info.value)
    del info
    released.check(faults)
    print(f"{faults.fired[0][0]} at read {faults.fired[0][1]}: stopped in {1e3 * stop_s:.1f} ms: {msg}")
    assert "\n" not in msg and within(stop_s, 1.0), stop_s
    return msg, stop_s


def where(target: Path, r) -> str:
    """The error's prefix for read r: the file, its layer and offset."""
    return re.escape(f"{target}: layer {r.layer}, offset {r.file_offset}: ")


def in_flight(target: Path, reads: dict, at: int) -> str:
    """The prefix naming any read in flight with read `at` (up to queue_depth 4 of them): a
    changed file is noticed by whichever read checks first."""
    return "(" + "|".join(where(target, r) for n, r in reads.items() if abs(n - at) < 4) + ")"


def recording(**kw) -> tuple[Faults, dict]:
    """Faults, and each read they saw by number (to name the one that failed)."""
    reads: dict = {}
    return Faults(on_read=lambda n, r: reads.__setitem__(n, r), **kw), reads


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("at", [PREFILL_READ, DECODE_READ], ids=["prefill", "decoding"])
def test_eio_ends_the_run_naming_file_layer_offset(target, kind, at):
    faults, reads = recording(eio_at=at)
    msg, _ = fails(config(target, kind), faults)
    assert re.match(where(target, reads[at]) + r"read of \d+ bytes failed \(Input/output error\) "
                    r"after 2 attempts$", msg)
    assert [f[0] for f in faults.fired] == ["eio", "eio"]  # the first try and one retry


@pytest.mark.parametrize("kind", KINDS)
def test_transient_eio_is_retried(target, reference, kind):
    faults = Faults(eio_at=DECODE_READ, eio_times=1)
    with inject(faults):
        res = run_pipeline(config(target, kind), PROMPT)
    assert [f[0] for f in faults.fired] == ["eio"] and res.tokens == reference[kind]


def test_no_retries_when_read_retries_is_0(target):
    faults, reads = recording(eio_at=DECODE_READ, eio_times=1)
    msg, _ = fails(config(target, "flash-ar", "flash.read_retries=0"), faults)
    assert re.match(where(target, reads[DECODE_READ]) + r"read of \d+ bytes failed \(Input/output error\)$", msg)


@pytest.mark.parametrize("kind", KINDS)
def test_short_read_ends_the_run(target, kind):
    faults, reads = recording(short_at=DECODE_READ)
    msg, _ = fails(config(target, kind), faults)
    assert re.match(where(target, reads[DECODE_READ]) + r"short read: 0 of \d+ bytes$", msg)


def test_partial_transfer_is_continued(target, reference):
    """A device may move fewer whole pages than asked; the store reads on from there."""
    faults = Faults(short_at=DECODE_READ, short_bytes=4096)
    with inject(faults):
        res = run_pipeline(config(target, "speculative"), PROMPT)
    assert [f[0] for f in faults.fired] == ["short"] and res.tokens == reference["speculative"]


@pytest.mark.parametrize("kind,mode", [("flash-ar", "direct"), ("flash-ar", "mmap"), ("speculative", "direct")])
def test_truncated_mid_run(target, kind, mode):
    """Truncated to nothing, as `cp other.gguf` over it does first: an error, never SIGBUS."""
    faults, reads = recording(truncate_at=DECODE_READ, truncate_to=0)
    msg, _ = fails(config(target, kind, f'flash.mode="{mode}"'), faults)
    assert re.match(in_flight(target, reads, DECODE_READ) + r".*"
                    r"\(file is now 0 bytes, was \d+: truncated or replaced while open\)$", msg)


@pytest.mark.parametrize("mode", ["direct", "mmap"])
def test_tensor_rows_are_the_files_bytes(pair_dir, mode):
    """What the head and untied embeddings are read with instead of the mapping."""
    with FlashStore(pair_dir / TARGET, FlashConfig(mode=mode)) as store:
        raw = store.file.raw("token_embd.weight")
        assert np.array_equal(store.tensor_rows("token_embd.weight"), raw)
        ids = np.array([0, 5, len(raw) - 1, 5])
        assert np.array_equal(store.tensor_rows("token_embd.weight", ids), raw[ids])


def test_untied_embeddings_truncated_mid_run(stories, disk_dir):  # noqa: F811
    """stories260K has its own output.weight: its embeddings are read through the store, row
    by row, and a truncated file is an error there too, naming the tensor."""
    path = disk_dir / "stories-truncated.gguf"
    shutil.copyfile(stories, path)
    cfg = load_config(None, [f'model.target="{path}"', "generate.n_predict=40"])
    faults = Faults(truncate_at=20, truncate_to=0)
    msg, _ = fails(cfg, faults)
    # the row's read fails, or, when the row was read before the cut landed, the check after it
    assert re.match(re.escape(f"{path}: ") + r"(layer \d+|tensor token_embd.weight( row \d+)?), offset \d+: ", msg)


@pytest.mark.parametrize("kind", KINDS)
def test_rewritten_in_place_mid_run(target, kind):
    faults, reads = recording(rewrite_at=DECODE_READ)
    msg, _ = fails(config(target, kind), faults)
    assert re.match(in_flight(target, reads, DECODE_READ) + "file changed while open$", msg)


def test_replaced_by_rename_goes_on_with_the_file_opened(target, reference):
    """A new file renamed over the path leaves the open one intact: same tokens, no error."""
    faults = Faults(replace_at=DECODE_READ)
    with inject(faults):
        res = run_pipeline(config(target, "speculative"), PROMPT)
    assert [f[0] for f in faults.fired] == ["replace"] and res.tokens == reference["speculative"]


def test_draft_file_truncated_mid_run_does_not_matter(pair_dir, reference, tmp_path):
    """The draft is resident: read into DRAM at load, not mapped, so its file truncated under a
    run (which, mapped, was a SIGBUS at the next draft forward) changes nothing."""
    draft = pair_dir / "draft-truncated.gguf"
    shutil.copyfile(pair_dir / DRAFT, draft)
    cfg = load_config(ROOT / "examples" / "default.toml", [
        f'model.target="{pair_dir / TARGET}"', f'model.draft="{draft}"', 'pipeline.baseline=""',
        "generate.n_predict=12", "flash.chunk_bytes=262144"])
    faults = Faults(on_read=lambda i, r: i == DECODE_READ and draft.write_bytes(b""))
    try:
        with inject(faults):
            res = run_pipeline(cfg, PROMPT)
        assert draft.stat().st_size == 0 and res.tokens == reference["speculative"]
    finally:
        draft.unlink(missing_ok=True)


@pytest.mark.parametrize("kind", KINDS)
def test_latency_spikes_are_waited_for(target, reference, kind):
    faults = Faults(slow_every=90, slow_s=0.3)
    with inject(faults):
        res = run_pipeline(config(target, kind), PROMPT)
    assert faults.fired and {f[0] for f in faults.fired} == {"slow"}
    assert res.tokens == reference[kind]


DRIVER = """
import sys
from lever.backends.flash import Faults, inject
from lever.cli.main import main
with inject(Faults(eio_at=int(sys.argv[1]))):
    sys.exit(main(sys.argv[2:]))
"""


def test_cli_streams_text_then_ends_with_the_error_line(target):
    """The CLI has streamed some text when the fault comes: it ends with the error line and
    exit 1, never with the run summary."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(DECODE_READ + 100), "run", "-c", str(ROOT / "examples" / "default.toml"),
         "-p", PROMPT, "-n", "40", "--set", f'model.target="{target}"',
         "--set", f'model.draft="{target.parent / DRAFT}"',
         "--set", 'pipeline.kind="flash-ar"', "--set", 'pipeline.baseline=""', "--set", "flash.chunk_bytes=262144"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stdout) > len(PROMPT)  # text was streamed before the fault
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and re.match(
        re.escape(f"lever: error: {target}: layer ") + r"\d+, offset \d+: read of \d+ bytes failed", err[0])
