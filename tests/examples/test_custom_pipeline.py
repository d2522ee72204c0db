"""examples/custom_pipeline.py composes Flash-AR by hand; it must give generate()'s tokens."""

import importlib.util

from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import generate
from lever.model.transformer import Model
from tests.conftest import ROOT


def test_custom_pipeline_equals_generate(stories, capsys):
    spec = importlib.util.spec_from_file_location("custom_pipeline", ROOT / "examples" / "custom_pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tokens = mod.main(str(stories), "Once upon a time", n=24)
    tok = Tokenizer.from_gguf(stories)
    assert tokens == generate(Model(stories), tok.encode("Once upon a time"), 24).tokens
    assert "Lily" in capsys.readouterr().out
