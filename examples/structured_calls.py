"""The same greedy structured request, five times: one text each time, valid JSON or `length`.

    python examples/structured_calls.py [CONFIG] [--spm]

Through the Python API, a config's pair (the shipped pair by default; examples/lever.toml for
the Qwen pair), or with --spm stories260K (a SentencePiece vocabulary, shipped in tests/data/models)
with a two-block copy of itself as its draft. For each prompt and schema it prints how many
distinct texts five calls gave, how they ended (`valid`: the end token, JSON the schema
accepts, checked with jsonschema; `length`: cut by max_tokens) and the text. Issue 44's
experiment: before it, "class A:" gave five texts, some ending on an unclosed object.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import jsonschema

import lever
from lever.shipped import shipped

SCHEMAS = ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
            "required": ["name", "n"], "additionalProperties": False},
           {"type": "object"}, {"type": "array", "items": {"type": "integer"}})


def five_calls(llm, prompts) -> None:
    for prompt in prompts:
        for schema in SCHEMAS:
            seen = {}
            for _ in range(5):
                c = llm.generate(prompt, max_tokens=64, json_schema=schema)
                verdict = "length"
                if c.finish_reason == "eos":
                    jsonschema.validate(json.loads(c.text), schema)
                    verdict = "valid"
                seen[c.text] = verdict
            (text, verdict), n = next(iter(seen.items())), len(seen)
            print(f"{prompt!r:20} {json.dumps(schema)[:36]:36} {n} text{'s' * (n > 1)}  {verdict:6}  {text[:60]!r}")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--spm"]
    if "--spm" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.deep_target import write_shallow_copy  # the repository's test helper

        stories = Path(__file__).resolve().parents[1] / "tests" / "data" / "models" / "stories260K.gguf"
        draft = write_shallow_copy(stories, Path(tempfile.mkdtemp()) / "stories-2.gguf", 2)
        with lever.load(target=stories, draft=draft, n_ctx=256) as llm:
            five_calls(llm, ["Once upon a time", "Lily had a"])
        return
    with lever.load(args[0] if args else shipped("default.toml"), overrides=['pipeline.baseline=""']) as llm:
        five_calls(llm, ["def f(x):", "class A:\n"])


if __name__ == "__main__":
    main()
