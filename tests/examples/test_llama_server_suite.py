"""examples/llama_server_shim.py's flag translation, as a plain function: llama-server's argv (as
llama.cpp's tests/utils.py writes it) -> lever serve's, with no server started."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("llama_server_shim", ROOT / "examples" / "llama_server_shim.py")
shim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shim)

# lever serve's flags before it took llama-server's model flags, and since
BEFORE = {"--host", "--port", "--api-key", "--metrics", "--threads", "--cache-ram", "-c", "--set"}
TODAY = BEFORE | {"-m", "--model", "-md", "--model-draft", "--ctx-size", "-a", "--alias", "-np", "--parallel",
                  "--slots", "--no-slots", "--kv-unified", "--tags", "-v", "--verbose"}
TINYLLAMA2 = ["--port", "8080", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline",
              "--hf-repo", "ggml-org/test-model-stories260K", "--batch-size", "32", "--no-slots", "--alias",
              "tinyllama-2", "--ctx-size", "512", "--parallel", "2", "--n-predict", "64", "--no-jinja"]


@pytest.fixture
def dirs(tmp_path: Path) -> list[Path]:
    for name in ("stories260K.gguf", shim.QWEN_TARGET, shim.QWEN_DRAFT):
        (tmp_path / name).write_bytes(b"GGUF")
    return [tmp_path]


def sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_the_tinyllama2_preset_becomes_stories260K_without_a_draft(dirs):
    argv, notes = shim.translate(TINYLLAMA2, serve_flags=BEFORE, dirs=dirs)
    assert f'model.target="{dirs[0]}/stories260K.gguf"' in sets(argv)
    assert 'model.draft=""' in sets(argv) and 'tree_expand.sources=["prompt-lookup","ngram"]' in sets(argv)
    for want in ("model.n_ctx=512", "generate.temperature=0.8", "generate.seed=42", "generate.n_predict=64"):
        assert want in sets(argv)
    assert argv[argv.index("--port") + 1] == "8080" and argv[argv.index("--host") + 1] == "127.0.0.1"
    for dropped in ("--batch-size", "--no-slots", "--parallel", "--no-jinja", "--offline", "--hf-repo"):
        assert dropped not in argv
    # not in lever serve's help then (--parallel and --no-slots are today's): said, not silently lost
    assert notes == ["--no-slots", "--alias tinyllama-2", "--parallel 2"]


def test_a_flag_lever_serve_lists_passes_unchanged(dirs):
    argv, notes = shim.translate(TINYLLAMA2, serve_flags=TODAY, dirs=dirs)
    assert argv[argv.index("--alias") + 1] == "tinyllama-2" and argv[argv.index("--ctx-size") + 1] == "512"
    assert argv[argv.index("--parallel") + 1] == "2" and "--no-slots" in argv  # today's lever serve has both
    assert argv[argv.index("--model") + 1] == f"{dirs[0]}/stories260K.gguf"  # the HF name, as lever's -m
    assert not any(s.startswith(("model.", "tree_expand.")) for s in sets(argv)) and notes == []


def test_model_flags_pass_when_lever_serve_takes_them(dirs):
    argv, _ = shim.translate(["--hf-repo", "ggml-org/x", "--hf-file", "y.gguf"],
                             serve_flags=TODAY | {"--hf-repo", "--hf-file"}, dirs=dirs)
    assert argv == ["--hf-repo", "ggml-org/x", "--hf-file", "y.gguf"]


@pytest.mark.parametrize("flags", [BEFORE, TODAY])
def test_the_qwen_target_gets_its_draft(dirs, flags):
    argv, _ = shim.translate(["--hf-repo", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "--hf-file", shim.QWEN_TARGET,
                              "--api-key", "k", "--metrics", "--seed", "-1"], serve_flags=flags, dirs=dirs)
    draft = str(dirs[0] / shim.QWEN_DRAFT)
    assert argv[argv.index("--model-draft") + 1] == draft if "--model-draft" in flags else \
        f'model.draft="{draft}"' in sets(argv)
    assert argv[argv.index("--api-key") + 1] == "k" and "--metrics" in argv and "generate.seed=-1" in sets(argv)


@pytest.mark.parametrize("argv", [
    ["--hf-repo", "ggml-org/models", "--hf-file", "bert-bge-small/ggml-model-f16.gguf"],
    ["--hf-repo", "ggml-org/tinygemma3-GGUF:Q8_0"],
    ["--port", "8080", "--n-predict", "16"],  # the router preset: no model at all
    ["--hf-repo", "ggml-org/models", "--hf-file", "tinyllamas/stories260K.gguf", "--model-draft", "tmp/draft.gguf"],
])
@pytest.mark.parametrize("flags", [BEFORE, TODAY])
def test_a_model_not_here_is_refused_with_the_reason(dirs, argv, flags):
    with pytest.raises(shim.Missing):
        shim.translate(argv, serve_flags=flags, dirs=dirs)


def test_a_chat_template_file_becomes_a_toml_string(dirs, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text('{{ "<s>" }}\n{% for m in messages %}\\{{ m.content }}{% endfor %}')
    argv, _ = shim.translate(["--model", str(dirs[0] / "stories260K.gguf"), "--jinja", "--chat-template-file",
                              str(template), "--n-predict", "-1", "--no-ui"], serve_flags=BEFORE, dirs=dirs)
    got = [s for s in sets(argv) if s.startswith("model.chat_template=")][0]
    assert tomllib.loads(got)["model"]["chat_template"] == template.read_text()
    assert "--no-page" in argv and not any(s.startswith("generate.n_predict") for s in sets(argv))
