"""`lever list`: the models in $LEVER_MODELS (name, size, path relative to it) and the
catalogue's names, pulled or not, as tables and as JSON."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lever.hub.catalogue import PAIRS, lookup
from tests.cli.test_pull import REPO, lever  # noqa: F401
from tests.hub.fake_hub import hub  # noqa: F401


def test_list_shows_what_is_there_and_the_catalogue(hub, stories, lever):  # noqa: F811
    root = Path(os.environ["LEVER_MODELS"])
    spec = hub.add(REPO, "tiny.gguf", b"G" * 2_500_000)
    assert lever("pull", spec).returncode == 0
    shutil.copyfile(stories, root / "stories260K.gguf")  # the catalogue's file, as a pull leaves it
    (root / "half.gguf.part").write_bytes(b"x" * 1000)
    out = json.loads(lever("list", "--json").stdout)
    assert out["root"] == str(root)
    assert [(m["name"], m["size"], m["path"], m["partial"]) for m in out["models"]] == [
        (spec, 2_500_000, spec, False), ("half.gguf", 1000, "half.gguf.part", True),
        ("stories260k", stories.stat().st_size, "stories260K.gguf", False)]
    state = {k["name"]: k["state"] for k in out["catalogue"]}
    assert state["stories260k"] == "pulled" and state["llama-2-tiny-random"] == "absent"
    assert set(state) == {e.name for e in lookup("qwen2.5-coder")} | set(PAIRS) | {"stories260k",
                                                                                    "llama-2-tiny-random"}
    text = lever("list").stdout
    assert f"$LEVER_MODELS: {root}" in text
    models, catalogue = text.split("\ncatalogue ", 1)
    rows = {line.split()[0]: line.split()[1:] for line in models.splitlines() if line.strip()}
    assert rows["stories260k"][:3] == ["1.2", "MB", "stories260K.gguf"]
    assert rows[spec] == ["2.5", "MB", spec]
    assert rows["half.gguf"] == ["1.0", "kB", "(partial)", "half.gguf.part"]
    states = {line.split()[0]: line.split()[1] for line in catalogue.splitlines()[2:] if line.strip()}
    assert states == state


def test_an_empty_folder_says_so(tmp_path, lever, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LEVER_MODELS", str(tmp_path / "none"))
    proc = lever("list")
    assert proc.returncode == 0 and "(no models yet)" in proc.stdout
    assert "qwen2.5-coder" in proc.stdout and "absent" in proc.stdout
