"""Lever from Python: `load` a pipeline once, then generate, stream and chat through it.

    lever.api.llm           load -> LLM: prepare a call, run or stream it; generate, stream, chat
    lever.api.call          Call (one generation, checked once), Completion, Chunk, Usage
    lever.api.text          the text as it leaves: stop strings, tool calls
    lever.api.conversation  Session: a conversation kept in both KV caches between calls
"""

from lever.api.call import Call, Cancelled, Chunk, Completion, Offer, Usage
from lever.api.conversation import Session
from lever.api.llm import LLM, load
from lever.api.text import StopStrings, with_call_stream, with_tool_calls

__all__ = ["Call", "Cancelled", "Chunk", "Completion", "LLM", "Offer", "Session", "StopStrings", "Usage", "load",
           "with_call_stream", "with_tool_calls"]
