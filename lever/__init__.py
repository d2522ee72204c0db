"""Lever: flash-resident speculative decoding.

`lever.load(...)` opens a pipeline for Python callers (lever.api); the rest of the package
loads on first use, so `import lever` stays cheap for the command line."""

_API = ("load", "LLM", "Completion", "Chunk", "Usage")


def __getattr__(name: str):
    if name in _API:
        from lever import api

        return getattr(api, name)
    raise AttributeError(f"module 'lever' has no attribute {name!r}")


__all__ = list(_API)
