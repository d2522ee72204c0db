#!/usr/bin/env python3
"""examples/llama_server_shim.py: llama-server's command line, run as `lever serve`.

llama.cpp's server test suite (tools/server/tests, run by examples/llama_server_suite.py) starts
`$LLAMA_SERVER_BIN_PATH` with llama-server's flags; this executable stands there. It turns the
command line into `python -m lever serve ...` and execs it (so the suite's SIGTERM reaches the
server itself):

    examples/llama_server_shim.py --port 8080 --temp 0.8 --hf-repo ggml-org/models \\
        --hf-file tinyllamas/stories260K.gguf --ctx-size 512 --no-slots --no-jinja

A flag `lever serve --help` lists is passed on unchanged ($LEVER_SERVE_FLAGS, comma-separated,
saves asking again at each start); otherwise TRANSLATE says what it becomes, and the rest is
dropped (NO_MEANING silently, anything else with a note on stderr). Model flags (--model,
--hf-repo, --hf-file, --model-draft) pass unchanged only if lever serve takes every one given;
else they name local files (HF is unreachable here), handed over as lever serve's -m/-md when it
has them, else as --set overrides: stories260K in the shared models, the Qwen2.5-Coder pair in
$LEVER_MODELS (the 1.5B gets the 0.5B as its draft). A preset whose model is not here, or the
router preset (no model), exits with MISSING (77, "skipped" to automake) and a sentence on stderr
and in $LLAMA_SUITE_MISSING, which the suite's plugin reports as a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lever.hub.store import models_dir

MISSING = 77
ROOT = Path(__file__).resolve().parents[1]
MODEL_FLAGS = ("--model", "--hf-repo", "--hf-file", "--model-draft")
# llama-server flags that mean nothing to a one-run speculative server (batching, GPU offload,
# KV types, the web UI's helpers, jinja on/off: Lever always renders the GGUF's template; lever serve takes
# --parallel, --kv-unified and --slots itself).
NO_MEANING = {"--batch-size", "--ubatch-size", "--n-gpu-layers", "-fa", "-ctk", "-ctv",
              "--swa-full", "--cont-batching", "--jinja", "--no-jinja",
              "--offline", "--no-cache-idle-slots", "--backend_sampling"}
# llama-server's short flags that mean something else to lever serve (-c is its config, not ctx-size).
NEVER_PASS = {"-c"}
# Repositories whose default file is one of the local ones (the suite's presets name no file).
HF_REPOS = {"ggml-org/test-model-stories260K": "stories260K.gguf"}
# llama-server's templates written in C++ (llama.cpp's src/llama-chat.cpp), named by --chat-template: Lever has
# none of them (but ChatML, its fallback's), so these are dropped with a note
BUILTIN_TEMPLATES = {"llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
                     "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4", "falcon3", "zephyr",
                     "monarch", "gemma", "orion", "openchat", "vicuna", "vicuna-orca", "deepseek", "deepseek2",
                     "deepseek3", "deepseek-ocr", "command-r", "llama3", "chatglm3", "chatglm4", "glmedge", "minicpm",
                     "exaone3", "exaone4", "exaone-moe", "rwkv-world", "granite", "granite-4.0", "granite-4.1",
                     "gigachat", "megrez", "yandex", "bailing", "bailing-think", "bailing2", "llama4", "smolvlm",
                     "hunyuan-moe", "gpt-oss", "hunyuan-dense", "hunyuan-vl", "kimi-k2", "seed_oss", "grok-2",
                     "pangu-embedded", "solar-open"}
QWEN_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


class Missing(Exception):
    """The command line asks for a model (or a mode) this machine does not have."""


def toml_str(text: str) -> str:
    """A TOML basic string: --set values are TOML (a chat template holds quotes and newlines)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def model_dirs() -> list[Path]:
    """Where the local models are, found as tests/conftest.py finds them: the small ones shipped
    with the tests, then $LEVER_MODELS (where `lever pull` puts the Qwen pair)."""
    return [ROOT / "tests" / "data" / "models", models_dir()]


def local(name: str, dirs: list[Path]) -> Path | None:
    for d in dirs:
        if (d / name).is_file():
            return d / name
    return None


def split_flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """llama-server's argv as (flag, value) pairs: the suite always writes a flag, then at most one
    value (which may be a negative number, as --seed -1)."""
    pairs: list[tuple[str, str | None]] = []
    for arg in argv:
        is_value = pairs and pairs[-1][1] is None and (not arg.startswith("-") or re.fullmatch(r"-[\d.]+", arg))
        if is_value:
            pairs[-1] = (pairs[-1][0], arg)
        else:
            pairs.append((arg, None))
    return pairs


def resolve_models(given: dict[str, str], dirs: list[Path]) -> tuple[Path, Path | None]:
    """The local target (and draft) that llama-server's model flags name."""
    repo = given.get("--hf-repo", "").split(":")[0]  # "owner/name:Q8_0" names a quantization
    name = given.get("--hf-file") or given.get("--model") or HF_REPOS.get(repo)
    if name is None:
        raise Missing(f"no model named ({repo or 'router mode'}): Lever serves one target")
    target = Path(name) if Path(name).is_file() else local(Path(name).name, dirs)
    if target is None:
        raise Missing(f"{repo + ':' if repo else ''}{name} is not on this machine (HF is unreachable)")
    draft_name = given.get("--model-draft") or (QWEN_DRAFT if target.name == QWEN_TARGET else None)
    draft = local(Path(draft_name).name, dirs) if draft_name else None
    if draft_name and draft is None and "--model-draft" in given:
        raise Missing(f"draft {draft_name} is not on this machine (HF is unreachable)")
    return target, draft


def model_args(target: Path, draft: Path | None, serve_flags: set[str]) -> list[str]:
    """The models in lever serve's own flags when it has them (-m, -md), else as config overrides."""
    if "--model" in serve_flags:
        out = ["--model", str(target)]
    else:
        out = ["--set", f"model.target={toml_str(str(target))}"]
    if draft is not None:
        return out + (["--model-draft", str(draft)] if "--model-draft" in serve_flags
                      else ["--set", f"model.draft={toml_str(str(draft))}"])
    if "--model" in serve_flags:
        return out  # lever serve -m without -md drafts from the prompt and the text so far itself
    # No draft sharing the target's tokenizer: trees come from the prompt and the text so far.
    return out + ["--set", 'model.draft=""', "--set", 'tree_expand.sources=["prompt-lookup","ngram"]']


def translated(flag: str, value: str | None) -> list[str] | None:
    """TRANSLATE: llama-server's flag as lever serve takes it today; None when it has no counterpart."""
    sets = {"--ctx-size": "model.n_ctx", "--temp": "generate.temperature", "--seed": "generate.seed",
            "--n-predict": "generate.n_predict"}
    if flag in sets and value is not None:
        if flag == "--n-predict" and int(value) < 1:
            return []  # -1 (until the context is full) has no Lever spelling: the config's own limit
        return ["--set", f"{sets[flag]}={value}"]
    if flag == "--chat-template-file" and value is not None:
        return ["--set", f"model.chat_template={toml_str(Path(value).read_text())}"]
    if flag == "--chat-template" and value is not None and value not in BUILTIN_TEMPLATES:
        # with --jinja (llama-server's default), the text is the template; "chatml" names its fallback's
        from lever.gguf.chat_template import CHATML
        return ["--set", f"model.chat_template={toml_str(CHATML if value == 'chatml' else value)}"]
    if flag == "--reasoning" and value in ("on", "off", "auto"):
        return ["--set", f"model.reasoning={toml_str(value)}"]
    if flag == "--no-ui":
        return ["--no-page"]  # llama-server's web UI at / is Lever's live page
    if flag == "--verbose":
        return ["--debug"]
    return None


def translate(argv: list[str], *, serve_flags: set[str], dirs: list[Path]) -> tuple[list[str], list[str]]:
    """llama-server's argv (without the program) -> (lever serve's argv, notes on dropped flags).
    Raises Missing when the model asked for is not here."""
    pairs = split_flags(argv)
    given = {f: v for f, v in pairs if f in MODEL_FLAGS and v is not None}
    # Model flags pass unchanged only when lever serve takes each of them (--hf-repo too: its own
    # resolution); else they all name local files. None at all is llama-server's router mode.
    passed = bool(given) and all(f in serve_flags for f in given)
    out = [] if passed else model_args(*resolve_models(given, dirs), serve_flags)
    notes: list[str] = []
    for flag, value in pairs:
        if flag in MODEL_FLAGS and not passed or flag in NO_MEANING:
            continue
        if flag in serve_flags and flag not in NEVER_PASS:
            out += [flag] + ([value] if value is not None else [])
        elif (args := translated(flag, value)) is not None:
            out += args
        else:
            notes.append(f"{flag} {value}" if value is not None else flag)
    return out, notes


def serve_flags_now() -> set[str]:
    """The flags `lever serve --help` lists (what the suite passes in $LEVER_SERVE_FLAGS)."""
    if os.environ.get("LEVER_SERVE_FLAGS"):
        return set(os.environ["LEVER_SERVE_FLAGS"].split(","))
    text = subprocess.run([sys.executable, "-m", "lever", "serve", "--help"], capture_output=True, text=True,
                          check=True).stdout
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))


def main() -> None:
    try:
        args, notes = translate(sys.argv[1:], serve_flags=serve_flags_now(), dirs=model_dirs())
    except Missing as e:
        print(f"llama_server_shim: {e}", file=sys.stderr, flush=True)
        if os.environ.get("LLAMA_SUITE_MISSING"):
            with open(os.environ["LLAMA_SUITE_MISSING"], "a") as f:
                f.write(f"{e}\n")
        sys.exit(MISSING)
    if notes:
        print(f"llama_server_shim: no Lever counterpart yet, dropped: {' '.join(notes)}", file=sys.stderr)
    command = [sys.executable, "-m", "lever", "serve", *args]
    print(f"llama_server_shim: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
