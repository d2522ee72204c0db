"""Lever from Python: `load` a pipeline once, then generate, stream and chat through it.

    lever.api.llm           load -> LLM: prepare a call, run or stream it; generate, stream, chat
    lever.api.call          Call (one generation, checked once), Completion, Chunk, Usage
    lever.api.conversation  Session: a conversation kept in both KV caches between calls
    lever.api.render        ChatRenderer: a chat's template run in a child process, its text bounded
"""

from lever.api.call import Call, Cancelled, Chunk, Completion, Offer, Usage
from lever.api.conversation import Session
from lever.api.llm import LLM, load

__all__ = ["Call", "Cancelled", "Chunk", "Completion", "LLM", "Offer", "Session", "Usage", "load"]
