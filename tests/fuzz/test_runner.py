"""The loader fuzzer (lever.fuzz): past findings stay fixed, a short hypothesis run finds nothing,
and the harness itself notices the failures it exists to find (exceptions, hangs, crashes).

tests/fuzz_corpus/ holds, gzipped, every input that made the loader or the tokenizer fail
with something other than a LeverError before the fix (its README says what each caught);
each must now load or be refused with one line naming the file. The full run is
`lever bench fuzz --n 100000`.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lever.errors import LeverError
from lever.fuzz import runner as fuzz
from lever.fuzz.inputs import Blob, RandomChooser, load_seeds, seed_from_desc, serialize
from lever.fuzz.models import model_desc
from lever.fuzz.runner import Outcome, Worker, check, check_bytes, make_input, read_corpus_file, run_fuzz
from tests.sizes import cases
from tests.tiny_gguf import write_tiny_model

CORPUS = Path(__file__).resolve().parents[1] / "fuzz_corpus"
CORPUS_FILES = sorted(CORPUS.glob("*.gguf.gz"))


def assert_clean(outcomes: list[Outcome]) -> None:
    bad = [o for o in outcomes if o.status == "finding"]
    assert not bad, bad


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name[:16] for p in CORPUS_FILES])
def test_corpus_input_loads_or_is_refused(path, tmp_path):
    assert_clean(check_bytes(read_corpus_file(path), tmp_path))


def test_corpus_is_there():
    assert len(CORPUS_FILES) >= 50
    readme = (CORPUS / "README.md").read_text()
    assert all(p.name in readme for p in CORPUS_FILES)


class HypothesisChooser:
    """The generators' decisions drawn from hypothesis, so a failing input shrinks."""

    def __init__(self, draw):
        self.draw = draw

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    tiny = write_tiny_model(tmp_path_factory.mktemp("seed") / "qwen2.gguf", "qwen2", "Q8_0", n_layer=1, n_embd=32,
                            n_ff=64, n_head=2, n_head_kv=1)
    return fuzz.default_seeds() + load_seeds([tiny])


@st.composite
def inputs(draw, seeds) -> Blob:
    return make_input(HypothesisChooser(draw), seeds)


def test_hypothesis_inputs_load_or_are_refused(seeds, tmp_path):
    @settings(max_examples=cases(300), derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(inputs(seeds))
    def run(blob):
        assert_clean(check(blob, tmp_path))

    run()


def test_clean_tiny_models_load_run_and_tokenize(tmp_path):
    for i in range(20):
        outcomes = check(serialize(model_desc(RandomChooser(random.Random(i)))), tmp_path)
        assert [o.status for o in outcomes] == ["ok", "ok"], outcomes


def test_seeds_load(seeds, tmp_path):
    assert len(seeds) >= 5
    for s in seeds:
        assert [o.status for o in check(s.blob, tmp_path)] == ["ok", "ok"], s.name


def test_blob_is_its_prefix_and_zeros(tmp_path):
    b = Blob(b"GGUF\x03", 10)
    b.write(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b.materialize() == b"GGUF\x03" + bytes(5)
    assert Blob.of(b.materialize()) == b and Blob(b"abcdef", 3).prefix == b"abc"


# --- the harness notices what it is for ---------------------------------------------------


def test_an_exception_other_than_lever_error_is_a_finding(monkeypatch, tmp_path):
    from lever.gguf.tokenizer import Tokenizer

    clean = seed_from_desc("tiny", model_desc(RandomChooser(random.Random(0))))
    def broken_decode(self, ids):
        raise IndexError("list index out of range")

    monkeypatch.setattr(Tokenizer, "decode", broken_decode)
    loader, tokenizer = check(clean.blob, tmp_path)
    assert loader.status == "ok" and tokenizer.status == "finding"
    assert tokenizer.signature.startswith("tokenizer: IndexError at runner.py:")  # where Lever called it


def test_a_lever_error_without_the_file_or_on_two_lines_is_a_finding(monkeypatch, tmp_path):
    from lever.model import transformer as model  # Model calls check_vocab from there

    clean = seed_from_desc("tiny", model_desc(RandomChooser(random.Random(0))))
    for message in ("no file named here", "{path}: two\nlines"):
        def fail(f, spec, message=message):
            raise LeverError(message.format(path=f.path))

        monkeypatch.setattr(model, "check_vocab", fail)
        loader, _ = check(clean.blob, tmp_path)
        assert loader.status == "finding" and "LeverError not one line naming the file" in loader.signature


def hang_or_crash(blob: Blob, workdir: Path, stage) -> list[Outcome]:
    """A stand-in for `check` in the worker: hangs or dies on request."""
    if blob.prefix == b"hang":
        stage.value = 1
        time.sleep(60)
    if blob.prefix == b"crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    return [Outcome("loader", "ok")]


def test_worker_reports_hangs_and_crashes_and_carries_on():
    w = Worker(mem_limit=0, fn=hang_or_crash)
    try:
        assert w.run(Blob(b"fine", 4), 30)[0].status == "ok"
        t0 = time.monotonic()
        (hang,) = w.run(Blob(b"hang", 4), 1.0)
        assert time.monotonic() - t0 < 10
        assert (hang.status, hang.signature) == ("finding", "tokenizer: hang")
        (crash,) = w.run(Blob(b"crash", 5), 30)
        assert crash.status == "finding" and crash.signature == "loader: crash" and str(-signal.SIGSEGV) in crash.detail
        assert w.run(Blob(b"fine", 4), 30)[0].status == "ok"
    finally:
        w.close()
    assert not w.workdir.exists()


def test_short_run_counts_every_input(tmp_path):
    report = run_fuzz(40, seed=1, corpus=tmp_path / "corpus", families={"gguf": 1})
    assert report.n == 40 and not report.findings and not report.saved
    assert sum(n for (t, _), n in report.counts.items() if t == "loader") == 40
    text = "\n".join(report.lines())
    assert "40 inputs" in text and "findings: 0 distinct" in text


def test_cli_bench_fuzz(tmp_path, capsys):
    from lever.cli.main import main

    assert main(["bench", "fuzz", "--n", "20", "--seed", "2", "--corpus", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fuzz: 20 inputs" in out and "loader" in out and "tokenizer" in out
