"""Chat templates: a conversation as the prompt text the model was tuned on.

An instruct model's GGUF carries its template as `tokenizer.chat_template`, the Jinja2 text
Hugging Face keeps in tokenizer_config.json. It is rendered the way `apply_chat_template`
does: in jinja2's sandboxed environment (a template is data from a file, not code), with
trimmed blocks and stripped leading whitespace, given `messages`, `add_generation_prompt`, the
special tokens as text (`bos_token`, `eos_token`) and `raise_exception`. The text it renders
holds the special tokens as strings; the tokenizer maps them back to their ids.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence

import attrs
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lever.errors import LeverError, shown
from lever.gguf.file import GGUFFile

TEMPLATE_KEY = "tokenizer.chat_template"
ROLES = ("system", "user", "assistant", "tool")


class TemplateError(LeverError):
    """The template itself refused the conversation (its `raise_exception`), or is broken."""


@attrs.frozen
class ChatTemplate:
    """A conversation -> prompt text renderer; `source` says where the template came from."""

    text: str
    source: str  # the GGUF file, or "config" / "code"
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_gguf(cls, f: GGUFFile, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        if not f.has(TEMPLATE_KEY):
            raise LeverError(f"{f.path}: no chat template ({TEMPLATE_KEY}); give one as chat_template "
                             "in code or [model] chat_template in the config")
        text = f.get(TEMPLATE_KEY)
        if not isinstance(text, str) or not text.strip():
            raise LeverError(f"{f.path}: {TEMPLATE_KEY} is not a non-empty string")
        return cls(text, str(f.path), bos_token, eos_token)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (each a dict with a `role` and a string `content`)."""
        checked = check_messages(messages)
        try:
            template = _environment().from_string(self.text)
            return template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"{self.source}: chat template: {type(e).__name__}: {shown(str(e))}") from None


def check_messages(messages) -> list[dict]:
    """Messages as the templates expect them, or one line naming the message and key at fault."""
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
        if not isinstance(content, str):
            raise LeverError(f"messages[{i}].content: must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _raise(message: str) -> None:
    raise TemplateError(f"chat template: {shown(str(message))}")


def _tojson(value, indent=None) -> str:
    # Hugging Face's tojson: plain JSON, non-ASCII kept (jinja2's own escapes HTML characters)
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
