"""Ollama's API over the one model (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`,
`/api/ps`, `/api/version`): a dialect of lever.serve.dialect. Being built (issue 48 item 4)."""

from __future__ import annotations

GENERATIONS: dict = {}  # route -> Dialect


def routes(server) -> list:
    """The routes that are not generations (the model's listing, details, the version)."""
    return []
