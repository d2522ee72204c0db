"""An OpenAI-compatible HTTP server over one open pipeline (lever.api.LLM): `lever serve`.

    connection (lever.serve.protocol) -> guard (lever.serve.guard: who may call)
        -> body (lever.serve.request) -> routes, queue, generation (lever.serve.server)
                                      -> the live page and its events (lever.serve.page)

`app` and `Server` import starlette (the serve extra), so they load on first use: the command
can check its flags and name a missing extra before that.
"""

TIMEOUT_S = 10.0  # a request's headers, its body, and a chat template's render may each take this long
MAX_CONNECTIONS = 64  # open at once; past it a connection gets 503 (a phone serves a few apps, not a crowd)
# the live page's files (lever/serve/static) -> media type: the only files served, and the paths
# the guard opens without a key (a browser cannot send one when it opens a page)
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "lever.js": "text/javascript; charset=utf-8",
              "lever.css": "text/css; charset=utf-8"}

__all__ = ["MAX_CONNECTIONS", "PAGE_FILES", "TIMEOUT_S", "Server", "app"]


def __getattr__(name: str):
    if name in ("Server", "app"):
        import importlib

        return getattr(importlib.import_module("lever.serve.server"), name)
    raise AttributeError(name)
