"""A chat's prompt text, bounded: the conversation through the chat template in a child process.

Beside lever.api.llm, whose LLM keeps one (`LLM.renderer`) and renders every chat through it, a
server's among them (lever.serve.prepare): a template is a program, run only in the child of
lever.gguf.render_child, which bounds its time and memory; the text it writes is bounded here by
what the context could hold (`max_prompt_bytes`), and the messages are checked and bounded by
the same rule before the template sees them. The child starts with the first chat (a third of a
second); a render then costs a fraction of a millisecond more than one in-process.
The template's `enable_thinking` is the model's `[model] reasoning` unless a call gives it (as
llama-server's --reasoning and a request's chat_template_kwargs).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from lever.errors import LeverError
from lever.gguf.chat_template import ChatTemplate, Rendered, check_messages, check_variables
from lever.gguf.render_child import RENDER_TIMEOUT_S, RenderProcess
from lever.gguf.tokenizer import Tokenizer


class PromptTooLong(LeverError):
    """Text that cannot fit the context, known by its bytes before it is tokenized: `field` the
    argument it came in ("messages", "prompt", ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@attrs.define
class ChatRenderer:
    """Renders conversations for one model: its tokenizer's special tokens (special-token text
    in a message stays text, ChatTemplate.render_marked), its context's byte bound."""

    tok: Tokenizer
    n_ctx: int
    n_ctx_source: str  # which limit set the context, for the refusals
    timeout_s: float = RENDER_TIMEOUT_S  # a render's time bound when the call gives none
    process: RenderProcess = attrs.field(factory=RenderProcess)  # its child starts with the first render
    reasoning: str = "auto"  # [model] reasoning: enable_thinking on, off, or as the template's thinking mode is

    @property
    def max_prompt_bytes(self) -> int:
        """The most bytes of text a prompt of n_ctx tokens could be: a token stands for at most
        the longest token's bytes (twice that, for normalizers that shorten text before the
        model sees it). Text of more is over the context before it is counted."""
        return 2 * self.n_ctx * self.tok.max_token_bytes

    def render(self, template: ChatTemplate, messages: Sequence[dict], tools: list[dict] | None = None, *,
               timeout_s: float | None = None, add_generation_prompt: bool = True,
               variables: dict | None = None, continue_final: bool = False) -> Rendered:
        """`messages` (checked: lever.gguf.chat_template.check_messages) through `template` with
        the functions `tools` offers (checked already: lever.model.tool_calls.check_tools) and
        the template's other `variables` (a request's chat_template_kwargs: check_variables), the
        last message continued or not (`continue_final`: lever.gguf.chat_template.continues), in
        the child, within `timeout_s` and `max_prompt_bytes`: a TemplateError naming the
        template's source for anything the template does, PromptTooLong for text the context
        cannot hold."""
        checked = check_messages(messages, continue_final)
        variables = check_variables(variables)
        if "enable_thinking" not in variables and self.reasoning != "auto":
            variables["enable_thinking"] = self.reasoning == "on"
        # a character is a byte at least: messages past the bound are refused before they are sent
        self.check_bytes(sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in checked), "messages",
                         unit="characters")
        rendered = self.process.render(template, checked, add_generation_prompt, specials=tuple(self.tok.specials),
                                       timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                                       max_chars=self.max_prompt_bytes, tools=tools, variables=variables,
                                       continue_final=continue_final)
        self.check_bytes(len(rendered.text.encode("utf-8", "replace")), "messages")
        return self.bos_first(rendered)

    def bos_first(self, rendered: Rendered) -> Rendered:
        """The prompt as llama-server tokenizes a chat's: a vocabulary that adds a BOS starts it
        with one, once (a template that writes it keeps its own; a message's BOS text at the
        start is text, and a BOS goes before it)."""
        bos = self._bos()
        if bos is None or rendered.text.startswith(bos) and 0 not in rendered.foreign:
            return rendered
        return Rendered(bos + rendered.text, tuple(i + len(bos) for i in rendered.foreign))

    def shown(self, rendered: Rendered) -> str:
        """The prompt's text as llama-server's /apply-template shows it: without the BOS the
        vocabulary adds (bos_first)."""
        bos = self._bos()
        if bos is None or not rendered.text.startswith(bos) or 0 in rendered.foreign:
            return rendered.text
        return rendered.text[len(bos):]

    def _bos(self) -> str | None:
        tok = self.tok
        return tok.token_text(tok.bos_id) if tok.add_bos and tok.bos_id is not None else None

    def check_bytes(self, n_bytes: int, field: str, unit: str = "bytes") -> None:
        """PromptTooLong when `n_bytes` of text in `field` (or as many characters: at least as
        many bytes) is more than the context can hold."""
        if n_bytes > self.max_prompt_bytes:
            raise PromptTooLong(field, f"{field}: {n_bytes} {unit} of text is more than the context of {self.n_ctx} "
                                       f"tokens can hold ({self.n_ctx_source})")

    def close(self, wait: bool = True) -> None:
        """Stops the child (a render under way fails at once); a render after it is refused.
        `wait`: and reaps it (not from a signal handler: it waits for a render's thread)."""
        if wait:
            self.process.stop()
        else:
            self.process.close()

