"""An OpenAI-compatible HTTP server over one open pipeline (lever.api.LLM): `lever serve`.

    connection (lever.serve.protocol) -> guard (lever.serve.guard: who may call)
        -> body (lever.serve.request) -> routes, queue, generation (lever.serve.server)

`app` and `Server` import starlette (the serve extra), so they load on first use: the command
can check its flags and name a missing extra before that.
"""

TIMEOUT_S = 10.0  # a request's headers, its body, and a chat template's render may each take this long

__all__ = ["TIMEOUT_S", "Server", "app"]


def __getattr__(name: str):
    if name in ("Server", "app"):
        import importlib

        return getattr(importlib.import_module("lever.serve.server"), name)
    raise AttributeError(name)
