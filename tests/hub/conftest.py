"""The hub tests' fixtures: a stand-in hub on 127.0.0.1 with $HF_ENDPOINT pointing at it, and
$LEVER_MODELS a fresh folder, so nothing here reaches a network or the developer's models."""

from __future__ import annotations

import pytest

from tests.hub.fake_hub import FakeHub


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        monkeypatch.setenv("LEVER_MODELS", str(tmp_path / "models"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield h
