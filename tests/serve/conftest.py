"""The live server most of tests/serve asks: `lever serve` on the shipped pair, the `openai`
client against it, and the same pair in-process (lever.api) to compare answers with. A module
that needs other flags defines its own `server`."""

from __future__ import annotations

import openai
import pytest

import lever
from lever.shipped import shipped
from tests.serve.live import TEMPLATE, start_server, stop


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm():
    with lever.load(shipped("default.toml"), chat_template=TEMPLATE) as m:
        yield m
