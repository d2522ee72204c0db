"""examples/llama_server_plugin.py: the pytest plugin examples/llama_server_suite.py loads (`-p
llama_server_plugin`, this folder on PYTHONPATH) into llama.cpp's server test suite, which runs
unchanged beside it.

It skips what does not apply to a one-model speculative server (SKIP_FILES, SKIP_TESTS, each with
its reason), turns a server the shim refused for a model this machine lacks (exit 77) into a skip,
bounds each test phase by $LLAMA_SUITE_TEST_TIMEOUT seconds (pytest-timeout is not installed
here), records the paths of the requests a server answered 404 (user properties in the JUnit XML,
so failures group by route), and makes ServerPreset.load_all a no-op: it only fills the HF cache,
and the hub is unreachable here.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

MISSING = 77
SKIP_FILES = {
    "test_embedding.py": "embeddings: a BERT embedding model, not a generator",
    "test_rerank.py": "rerank: a reranker model, not a generator",
    "test_lora.py": "LoRA adapters: Lever serves the GGUF as it is",
    "test_vision_api.py": "vision/multimodal: an mmproj beside the model",
    "test_router.py": "router: several models behind one server",
    "test_mcp_servers.py": "MCP servers: the web UI's tool servers",
    "test_tools_builtin.py": "built-in tools (/tools: shell, files): the web UI's agent",
    "test_proxy.py": "CORS proxy (/cors-proxy) for the web UI's MCP",
    "test_sleep.py": "sleep: unloading the model when idle",
    "test_compat_gcp.py": "GCP Vertex AI compatibility (AIP_MODE /predict)",
    "test_slot_save.py": "slot save/restore to files",
    "test_kv_keep_only_active.py": "idle slots' KV to the RAM cache: asserts llama-server's own log tags",
    "test_stream.py": "router: conversation streams resumed through a router's children (/v1/stream)",
    "test_speculative.py": "llama-server's draft knobs on stories15M MoE + a draft fetched from HF (neither here)",
}
# (file, test name or its prefix before "[") -> reason
SKIP_TESTS = {
    ("test_metrics.py", "test_metrics_embedding_prompt_is_counted"): "embeddings: a BERT embedding model",
    ("test_security.py", "test_cors_origins_localhost_reflects"): "router: a server with no model",
    ("test_security.py", "test_cors_origins_localhost_rejects"): "router: a server with no model",
    ("test_security.py", "test_cors_origins_defaults_to_localhost_with_tools_enabled"):
        "router + built-in tools: a server with no model",
    ("test_security.py", "test_cors_proxy_only_forwards_explicit_proxy_headers"): "CORS proxy for the web UI's MCP",
    ("test_security.py", "test_local_media_file"): "vision/multimodal: local image files",
    ("test_compat_anthropic.py", "test_anthropic_vision_base64_with_multimodal_model"): "vision/multimodal",
    ("test_compat_anthropic.py", "test_anthropic_tool_result_with_image"): "vision/multimodal",
    ("test_completion.py", "test_n_probs_post_backend_sampling"): "GPU backend sampling",
}


def skip_reason(file: str, name: str) -> str | None:
    if file in SKIP_FILES:
        return SKIP_FILES[file]
    return SKIP_TESTS.get((file, name.split("[")[0]))


def pytest_collection_modifyitems(items):
    for item in items:
        reason = skip_reason(Path(str(item.fspath)).name, item.name)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not for Lever: {reason}"))
    patch_utils()


_requests: list[tuple[str, str, int]] = []


def patch_utils():
    """The suite's utils, imported by its conftest: no preset loading, and requests recorded."""
    utils = sys.modules.get("utils")
    if utils is None or getattr(utils, "_lever_patched", False):
        return
    utils._lever_patched = True
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    make_request, make_stream_request = utils.ServerProcess.make_request, utils.ServerProcess.make_stream_request

    def recorded(self, method, path, *args, **kwargs):
        res = make_request(self, method, path, *args, **kwargs)
        _requests.append((method, path.split("?")[0], res.status_code, error_message(res.body)))
        return res

    def recorded_stream(self, method, path, *args, **kwargs):
        try:
            yield from make_stream_request(self, method, path, *args, **kwargs)
        except utils.ServerError as e:
            _requests.append((method, path.split("?")[0], e.code, error_message(e.body)))
            raise

    utils.ServerProcess.make_request = recorded
    utils.ServerProcess.make_stream_request = recorded_stream


def error_message(body) -> str:
    """What an error reply said ({"error": {"message": ...}} in both servers' shape), else ""."""
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message", "") if isinstance(error, dict) else error or "")


class PhaseTimeout(Exception):
    """A test phase ran past $LLAMA_SUITE_TEST_TIMEOUT: the file goes on with the next test."""


def _alarm(signum, frame):
    raise PhaseTimeout(f"test phase over {os.environ.get('LLAMA_SUITE_TEST_TIMEOUT')} s")


def _bounded():
    seconds = float(os.environ.get("LLAMA_SUITE_TEST_TIMEOUT", "0") or 0)
    if seconds > 0:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _bounded())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _requests.clear()
    return (yield from _bounded())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _bounded())


def missing_model() -> str:
    path = os.environ.get("LLAMA_SUITE_MISSING")
    lines = Path(path).read_text().splitlines() if path and Path(path).exists() else []
    return lines[-1] if lines else "the preset's model is not on this machine"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    exc = call.excinfo.value if call.excinfo else None
    if isinstance(exc, RuntimeError) and f"return code {MISSING}" in str(exc):
        rep.outcome = "skipped"
        rep.longrepr = (str(item.fspath), item.location[1] or 0, f"Skipped: model not here: {missing_model()}")
    elif rep.failed and call.when == "call":
        # on the item: JUnit XML writes the properties its teardown report carries
        for method, path, status, _ in _requests:
            if status == 404:
                item.user_properties.append(("404", f"{method} {path}"))
        if _requests:
            method, path, status, said = _requests[-1]
            item.user_properties.append(("last_request", f"{method} {path} -> {status}"))
            item.user_properties.append(("last_error", said))
    return rep
