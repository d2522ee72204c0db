"""Chat templates: a conversation as the prompt text the model was tuned on.

An instruct model's GGUF carries its template as `tokenizer.chat_template`, the Jinja2 text
Hugging Face keeps in tokenizer_config.json; a GGUF with none chats in ChatML (CHATML), as
llama-server does. It is rendered the way `apply_chat_template` does: in jinja2's sandboxed
environment (a template is data from a file, not code), with trimmed blocks and stripped leading
whitespace, given `messages`, `add_generation_prompt`, the special tokens as text (`bos_token`,
`eos_token`) and `raise_exception`; and what llama-server gives its templates beside them
(`Inputs`): the functions offered (`tools`), today's date (`date_string`, `datetime`,
`strftime_now`), `enable_thinking`, a request's `chat_template_kwargs`. The text it renders
holds the special tokens as strings; the tokenizer maps them back to their ids, but only the
template's own: special-token text inside a message's content is the user's text, never a
control token (`render_marked` says which are which), or any chat user could forge turns.

A template is bounded here by the length of what it writes; its time and memory are bounded by
the process that renders it (lever.gguf.render_child, for a server).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
from collections.abc import Sequence

import attrs
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lever.errors import LeverError, shown
from lever.gguf.file import GGUFFile
from lever.nesting import check_json, depth, text_depth

TEMPLATE_KEY = "tokenizer.chat_template"
ROLES = ("system", "user", "assistant", "tool")
MAX_RENDER_CHARS = 16 << 20  # what any context a model has could hold, many times over
# stands in for the first character of special-token text inside a message while the template
# is rendered a second time (a private-use character: no vocabulary's special token holds it)
DEFUSE = "\ue000"
MAX_NESTING = 64  # levels of a call's arguments or a tool's schema: parsers and templates recurse per level
# llama-server's fallback for a model with no template (llama.cpp's common/chat.cpp renders the
# same text): each message as a ChatML turn, then the assistant's
CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\\n' -}}\n"
          "{%- endif -%}")
FALLBACK = " (no chat template: ChatML, llama-server's fallback)"  # its source: the file, then this
# the names the renderer gives a template itself: a request's chat_template_kwargs cannot replace them
# (messages and tools are checked on their own fields)
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                      "strftime_now"})
# a conversation that tells whether a template has a thinking mode (llama-server probes with it)
PROBE = ({"role": "user", "content": "test"},)


class TemplateError(LeverError):
    """The template itself refused the conversation (its `raise_exception`), or is broken."""


@attrs.frozen
class ChatTemplate:
    """A conversation -> prompt text renderer; `source` says where the template came from."""

    text: str
    source: str  # the GGUF file, or "config" / "code"
    bos_token: str = ""
    eos_token: str = ""
    fallback: bool = False  # the GGUF has none: ChatML, llama-server's fallback

    @classmethod
    def from_gguf(cls, f: GGUFFile, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The GGUF's template; ChatML when it has none (or an empty one), as llama-server does."""
        text = f.get(TEMPLATE_KEY) if f.has(TEMPLATE_KEY) else ""
        if not isinstance(text, str):
            raise LeverError(f"{f.path}: {TEMPLATE_KEY} is not a string")
        if not text.strip():
            return cls(CHATML, f"{f.path}{FALLBACK}", bos_token, eos_token, fallback=True)
        return cls(text, str(f.path), bos_token, eos_token)

    @property
    def note(self) -> str | None:
        """The line a command says at its start when chats use the fallback, else None."""
        if not self.fallback:
            return None
        return (f"{self.source.removesuffix(FALLBACK)}: no chat template; chats use ChatML (llama-server's "
                "fallback); give one with [model] chat_template")

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
               max_chars: int = MAX_RENDER_CHARS, tools: list[dict] | None = None,
               variables: dict | None = None, continue_final: bool = False) -> str:
        """The prompt for `messages` (each a dict with a `role` and a string `content`; an
        assistant's `tool_calls` and `reasoning_content`, a tool's `tool_call_id`), with the
        functions `tools` offers (OpenAI's shape, checked: lever.model.tool_calls.check_tools) and
        the template's other `variables` (check_variables; enable_thinking, when not among them,
        as the template's thinking mode is); `continue_final`: the last message a reply the model
        goes on with (`continues`); a TemplateError when the template fails in any way or writes
        more than `max_chars`."""
        inputs = self._inputs(add_generation_prompt, tools, check_variables(variables))
        return self._written(check_messages(messages, continue_final), inputs, max_chars, continue_final)

    def render_marked(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                      specials: Sequence[str], max_chars: int = MAX_RENDER_CHARS,
                      tools: list[dict] | None = None, variables: dict | None = None,
                      continue_final: bool = False) -> Rendered:
        """The prompt, and where special-token text came from the messages' content (`foreign`:
        the offsets of those occurrences, to be tokenized as text). Found by rendering again
        with each such occurrence defused (its first character replaced) in every string the
        template may write: contents, a tool message's `tool_call_id`, a call's id, name and
        arguments, the tools' definitions, the variables. What the template wrote itself is the
        same in both; a template that changes length with those characters (an escaping
        `tojson`) cannot be told apart, and the conversation is refused."""
        checked = check_messages(messages, continue_final)
        if tools is not None and depth(tools) > MAX_NESTING + 4:  # [{function: {parameters: ...}}]
            raise TemplateError(f"tools: nest deeper than {MAX_NESTING} levels")
        inputs = self._inputs(add_generation_prompt, tools, check_variables(variables))
        text = self._written(checked, inputs, max_chars, continue_final)
        pattern = special_pattern(specials)
        if pattern is None:
            return Rendered(text, ())
        defused_messages, defused_inputs = _defused(checked, pattern), inputs.defused(pattern)
        if defused_messages == checked and defused_inputs == inputs:
            return Rendered(text, ())
        other = self._written(defused_messages, defused_inputs, max_chars, continue_final)
        refused = TemplateError(f"{self.source}: chat template: a message or tool holds special-token text the "
                                "template rewrites; refused (it would be read as control tokens)")
        if len(other) != len(text):
            raise refused
        foreign = []
        for m in pattern.finditer(text):
            i = m.start()
            if other[i] == DEFUSE:
                foreign.append(i)
            elif other[i : m.end()] != m.group():
                raise refused
        return Rendered(text, tuple(foreign))

    def thinks(self) -> bool:
        """Whether the template has a thinking mode: its prompt for PROBE differs with
        `enable_thinking` (llama-server's test, for --reasoning auto); a template that fails on
        the probe has none."""
        return "enable_thinking" in self.text and _thinks(self)

    def _inputs(self, add_generation_prompt: bool, tools: list[dict] | None, variables: dict | None) -> Inputs:
        """What the template reads beside the messages: `enable_thinking` as the template's
        thinking mode is unless `variables` give it; the date once (both renders of
        render_marked see the same)."""
        variables = dict(variables or {})
        if "enable_thinking" not in variables:
            variables["enable_thinking"] = self.thinks()
        return Inputs(bool(add_generation_prompt), tools or None, variables, datetime.datetime.now())

    def _written(self, checked: list[dict], inputs: Inputs, max_chars: int, continue_final: bool) -> str:
        """The prompt: the conversation; or, continuing its last message, the rest with the
        assistant's turn opened (what add_generation_prompt adds to it) and that message's text
        after it, as llama-server writes a prefill."""
        if not continue_final:
            return self._render(checked, inputs, max_chars)
        head, last = checked[:-1], checked[-1]
        closed = self._render(head, attrs.evolve(inputs, add_generation_prompt=False), max_chars)
        opened = self._render(head, attrs.evolve(inputs, add_generation_prompt=True), max_chars)
        text = closed + opened[len(os.path.commonprefix([closed, opened])):] + last["content"]
        if len(text) > max_chars:
            raise TemplateError(f"{self.source}: chat template: wrote more than {max_chars} characters")
        return text

    def _render(self, checked: list[dict], inputs: Inputs, max_chars: int) -> str:
        try:
            template = _compiled(self.text)
            parts, n = [], 0
            for piece in template.generate(messages=checked, bos_token=self.bos_token, eos_token=self.eos_token,
                                           **inputs.context()):
                n += len(piece)
                if n > max_chars:
                    raise TemplateError(f"{self.source}: chat template: wrote more than {max_chars} characters")
                parts.append(piece)
            return "".join(parts)
        except TemplateError as e:  # raise_exception's own words: say whose template
            if str(e).startswith(self.source):
                raise
            raise TemplateError(f"{self.source}: {e}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"{self.source}: chat template: {type(e).__name__}: {shown(str(e))}") from None
        except MemoryError:
            raise TemplateError(f"{self.source}: chat template: ran out of memory") from None
        except RecursionError:
            raise TemplateError(f"{self.source}: chat template: recursion too deep") from None
        except Exception as e:  # noqa: BLE001 -- a template is data: whatever it raises is its failure, one line
            raise TemplateError(f"{self.source}: chat template: {type(e).__name__}: {shown(str(e))}") from None


@attrs.frozen
class Inputs:
    """What a template reads beside the conversation, as llama-server gives it."""

    add_generation_prompt: bool = True
    tools: list[dict] | None = None  # none: `tools` undefined (templates test `if tools`)
    variables: dict = attrs.field(factory=dict)  # enable_thinking, a request's chat_template_kwargs
    now: datetime.datetime = attrs.field(factory=datetime.datetime.now)

    def context(self) -> dict:
        """The template's variables: today's date as llama-server writes it (`date_string`, Llama
        3's; `datetime`, firefunction's; `strftime_now`), then the variables given."""
        now = self.now
        out = {"add_generation_prompt": self.add_generation_prompt, "date_string": now.strftime("%d %b %Y"),
               "datetime": now.strftime("%b %d %Y"), "strftime_now": lambda fmt: now.strftime(str(fmt))}
        if self.tools:
            out["tools"] = self.tools
        return out | self.variables

    def defused(self, pattern: re.Pattern) -> Inputs:
        return attrs.evolve(self, tools=_defused(self.tools, pattern), variables=_defused(self.variables, pattern))


@functools.lru_cache(maxsize=8)
def _thinks(template: ChatTemplate) -> bool:
    try:
        on, off = (template._render(list(PROBE), Inputs(True, None, {"enable_thinking": b}), MAX_RENDER_CHARS)
                   for b in (True, False))
    except TemplateError:
        return False
    return on != off


def check_variables(variables) -> dict:
    """A request's `chat_template_kwargs` as template variables (llama-server's): an object of
    JSON values, none nesting past MAX_NESTING, none of the names the renderer gives itself
    (RESERVED); `enable_thinking` a boolean."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise LeverError(f"chat_template_kwargs: must be an object, got {type(variables).__name__}")
    check_json(variables, "chat_template_kwargs", max_depth=MAX_NESTING)
    for name in variables:
        if name in RESERVED:
            raise LeverError(f"chat_template_kwargs.{name}: the server sets it (give it as the request's field)")
    if "enable_thinking" in variables and not isinstance(variables["enable_thinking"], bool):
        raise LeverError("chat_template_kwargs.enable_thinking: must be a boolean, got "
                         f"{type(variables['enable_thinking']).__name__}")
    return dict(variables)


@attrs.frozen
class Rendered:
    """A rendered conversation: its text, and the offsets of special-token text in it that came
    from the messages (to be tokenized as text, lever.gguf.tokenizer.Tokenizer.encode_chat)."""

    text: str
    foreign: tuple[int, ...] = ()


@functools.lru_cache(maxsize=8)
def _pattern(specials: tuple[str, ...]) -> re.Pattern | None:
    # longest first: at one position the longest special matches, as the tokenizer's split does
    ordered = sorted({s for s in specials if s}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def special_pattern(specials: Sequence[str]) -> re.Pattern | None:
    return _pattern(tuple(specials))


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's `tool_calls` (OpenAI's), as templates read them: each a function
    with its name and its arguments as an object (Hugging Face's convention; OpenAI sends text)."""
    if not isinstance(calls, list):
        raise LeverError(f"messages[{i}].tool_calls: must be a list")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise LeverError(f"{where}: must be {{id, type: function, function: {{name, arguments}}}}")
        args = f.get("arguments", {})
        if isinstance(args, str):
            if text_depth(args) > MAX_NESTING:
                raise LeverError(f"{where}.function.arguments: nests deeper than {MAX_NESTING} levels")
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise LeverError(f"{where}.function.arguments: not valid JSON") from None
        check_json(args, f"{where}.function.arguments", max_depth=MAX_NESTING)  # JSON, no cycle: templates recurse
        if not isinstance(args, dict):
            raise LeverError(f"{where}.function.arguments: must be a JSON object")
        out.append({"id": _id(c.get("id", ""), f"{where}.id"), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def _id(value, where: str) -> str:
    """A call's id (a string; a 64-bit number is taken as its text): anything else is refused,
    not written with str(), which recurses into a nested value."""
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() <= 64:
        return int.__repr__(value)
    raise LeverError(f"{where}: must be a string, got {type(value).__name__}")


def check_messages(messages, continuing: bool = False) -> list[dict]:
    """Messages as the templates expect them, or one line naming the message and key at fault.
    `continuing`: the last is a reply the model goes on with (`continues`): an assistant's
    without tool calls, its parts joined by blank lines (llama-server's render_content)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise LeverError(f"messages: must be a list of {{'role': ..., 'content': ...}}, got {type(messages).__name__}")
    if not messages:
        raise LeverError("messages: the conversation is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise LeverError(f"messages[{i}]: must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise LeverError(f"messages[{i}].role: must be one of {', '.join(ROLES)}, got {role!r}")
        calls = _tool_calls(i, m["tool_calls"]) if role == "assistant" and m.get("tool_calls") else None
        if content is None and calls:  # a reply that only calls
            content = ""
        if isinstance(content, list):  # OpenAI's content parts: the texts joined by lines, as llama-server does
            content = _joined_parts(i, content, "\n\n" if continuing and i == len(messages) - 1 else "\n")
        if not isinstance(content, str):
            raise LeverError(f"messages[{i}].content: must be a string, got {type(content).__name__}")
        checked = {"role": role, "content": content}
        if calls:
            checked["tool_calls"] = calls
        reasoning = m.get("reasoning_content") if role == "assistant" else None
        if reasoning is not None:  # an earlier turn's thinking, for templates that show it (llama-server's field)
            if not isinstance(reasoning, str):
                raise LeverError(f"messages[{i}].reasoning_content: must be a string, got {type(reasoning).__name__}")
            checked["reasoning_content"] = reasoning
        if role == "tool" and m.get("tool_call_id") is not None:
            checked["tool_call_id"] = _id(m["tool_call_id"], f"messages[{i}].tool_call_id")
        out.append(checked)
    if continuing and (out[-1]["role"] != "assistant" or "tool_calls" in out[-1]):
        raise LeverError(f"messages[{len(out) - 1}]: a reply to continue must be the assistant's, without tool_calls")
    return out


def continues(messages, add_generation_prompt=None, continue_final_message=None) -> bool:
    """Whether a chat goes on with its last message rather than starting a reply (llama-server's
    rule): when `continue_final_message` asks it (true or "content"; add_generation_prompt then
    false), or when the last message is the assistant's (a prefill; not two of them)."""
    if continue_final_message not in (None, False):
        if continue_final_message == "reasoning_content":
            raise LeverError("continue_final_message: continuing a reply's reasoning is not supported (true or "
                             "\"content\")")
        if continue_final_message not in (True, "content"):
            raise LeverError(f"continue_final_message: must be true or \"content\", got "
                             f"{shown(str(continue_final_message))[:40]}")
        if add_generation_prompt is not False:
            raise LeverError("continue_final_message: cannot be given with add_generation_prompt true (its default): "
                             "a reply is continued or started, not both")
        return True
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages[-2:]] \
        if isinstance(messages, list) else []
    if roles[-1:] != ["assistant"]:
        return False
    if roles == ["assistant", "assistant"]:
        raise LeverError("messages: two assistant messages last: only one reply can be continued")
    return True


def _joined_parts(i: int, parts: list, by: str = "\n") -> str:
    """A message's content given as parts ([{"type": "text", "text": ...}]): their texts joined
    (by newlines); a part of another kind (an image) is refused: no model here sees one."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise LeverError(f"{where}: only text parts are supported (this model reads no "
                             f"{kind if isinstance(kind, str) else 'untyped'} content), got {shown(str(kind))[:40]}")
        if not isinstance(part.get("text"), str):
            raise LeverError(f"{where}.text: must be a string")
        texts.append(part["text"])
    return by.join(texts)


def _defused(value, pattern: re.Pattern):
    """`value` with the first character of every special-token text in its strings (keys too)
    replaced by DEFUSE; its nesting is bounded before (MAX_NESTING)."""
    if isinstance(value, str):
        return pattern.sub(lambda x: DEFUSE + x.group()[1:], value)
    if isinstance(value, dict):
        return {_defused(k, pattern): _defused(v, pattern) for k, v in value.items()}
    if isinstance(value, list):
        return [_defused(v, pattern) for v in value]
    return value


def _raise(message: str) -> None:
    raise TemplateError(f"chat template: {shown(str(message))}")


def _tojson(value, indent=None) -> str:
    # Hugging Face's tojson: plain JSON, non-ASCII kept (jinja2's own escapes HTML characters)
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.lru_cache(maxsize=8)
def _compiled(text: str) -> jinja2.Template:
    """A template's text compiled once (12 ms for Qwen2.5's; a render of it takes 0.1 ms): a
    renderer's child keeps the few templates it is sent. A compile that fails is not kept."""
    return _environment().from_string(text)


class _Environment(ImmutableSandboxedEnvironment):
    """jinja2's sandbox, with llama-server's `+`: a string and an undefined or none value make
    the string (templates written for llama-server add variables it leaves unset, as
    firefunction-v2's `functions`)."""

    intercepted_binops = frozenset({"+"})

    def call_binop(self, context, operator, left, right):
        if operator == "+" and isinstance(left, str) and _unset(right):
            return left
        if operator == "+" and isinstance(right, str) and _unset(left):
            return right
        return super().call_binop(context, operator, left, right)


def _unset(value) -> bool:
    return value is None or isinstance(value, jinja2.Undefined)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env
