"""Tool calls, as the API and the server use them: the door to lever.model.tools.

Lever reads calls in the format a model's chat template teaches it (lever.model.tools.formats:
Hermes/Qwen's <tool_call> blocks, Llama 3.x's JSON, Mistral's [TOOL_CALLS], FireFunction's
functools, fenced JSON, llama.cpp's generic JSON), detected once per template text (`detect`).
`parse_calls` splits a reply into its text and its calls (OpenAI's shape: an id, the function's
name, its arguments as a JSON string); `CallStream` does so as the reply streams, holding back
only what may begin a call; `plan`/`required` build the grammar that makes a reply one or more
calls of the given functions in that format (OpenAI's tool_choice "required", or a named function).
"""

from lever.model.tools.calls import ToolCall
from lever.model.tools.formats import BY_NAME, FORMATS, GENERIC, HERMES, ToolFormat, detect
from lever.model.tools.plan import MAX_TOOLS, check_tools, plan, required
from lever.model.tools.stream import CallStream, parse_calls

__all__ = ["BY_NAME", "FORMATS", "GENERIC", "HERMES", "MAX_TOOLS", "CallStream", "ToolCall", "ToolFormat",
           "check_tools", "detect", "parse_calls", "plan", "required"]
