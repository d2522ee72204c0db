"""Anthropic's Messages API over the one model (`/v1/messages`): a dialect of lever.serve.dialect.
Being built (issue 48 item 4)."""

from __future__ import annotations

GENERATIONS: dict = {}  # route -> Dialect


def routes(server) -> list:
    """The routes that are not generations (token counting)."""
    return []
