"""The files llama-server's web UI asks its server for, as Lever answers them (beside the live
page at /, lever.serve.page), and the build string both servers sign their answers with.

A browser that once opened llama-server's web UI on this address keeps its service worker,
which asks for /sw.js to update itself, and its pages ask for /manifest.webmanifest and
/_app/version.json. Here /sw.js is a worker that unregisters itself (so a cached web UI no longer
stands in for Lever's page), the manifest names the live page, and version.json Lever's build.
Static, nothing secret: lever.serve.guard serves them without a key, as llama-server does. No
starlette here (the guard imports it before the serve extra is checked).
"""

from __future__ import annotations

import importlib.metadata
import json


def _version() -> str:
    try:
        return importlib.metadata.version("lever")
    except importlib.metadata.PackageNotFoundError:  # a source tree run without installing
        return "0"


# llama-server's build string is b<build>-<commit> (OpenAI's system_fingerprint, /props' build_info);
# Lever's is its version where the build number stands and its name where the commit does
BUILD = f"b{_version()}-lever"

_SW = ("// Lever: a service worker left by another server's web UI on this address, replaced and unregistered\n"
       "self.addEventListener('install', () => self.skipWaiting());\n"
       "self.addEventListener('activate', (e) => e.waitUntil(self.registration.unregister()));\n")
_MANIFEST = {"name": "Lever", "short_name": "Lever", "start_url": "/", "display": "standalone",
             "description": "the trees a lever serve verifies, live"}

# path -> (media type, body)
WEB_UI_FILES = {
    "/sw.js": ("text/javascript; charset=utf-8", _SW.encode()),
    "/manifest.webmanifest": ("application/manifest+json", json.dumps(_MANIFEST).encode()),
    "/_app/version.json": ("application/json", json.dumps({"version": BUILD}).encode()),
}
