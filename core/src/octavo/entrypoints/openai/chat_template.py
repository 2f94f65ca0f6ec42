"""Chat templates rendered in a sandboxed jinja environment.

The template is the tokenizer's (``tokenizer_config.json``'s ``chat_template``) or the one given
with ``--chat-template`` (a file path or the template text itself). Templates come from model
repositories, i.e. from strangers: they run in jinja's ``ImmutableSandboxedEnvironment``, which
refuses attribute access to internals and mutation of the objects passed in.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or refused the conversation."""


def load_chat_template(source: str | None, tokenizer: Any) -> str | None:
    """The template text: ``source`` (a path or inline jinja) or the tokenizer's; None if neither."""
    if source is not None:
        path = Path(source).expanduser()
        try:
            if path.is_file():
                return path.read_text(encoding="utf-8")
        except OSError:  # e.g. a template too long to be a file name
            pass
        if "{" not in source:
            raise ChatTemplateError(f"--chat-template {source!r} is neither a file nor a jinja template")
        return source
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template if isinstance(template, str) else None


# Variables the renderer sets itself: ``chat_template_kwargs`` may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "unk_token",
    "pad_token", "raise_exception", "strftime_now"})
# At most this many extra template variables, and this many characters of them (as JSON).
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 16_384


def check_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` if they can be given to a template as extra variables (Qwen3's
    ``enable_thinking``, for instance); ``ChatTemplateError`` saying what is wrong otherwise."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ChatTemplateError(f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs are "
                                f"accepted, got {len(kwargs)}")
    for name in kwargs:
        if not name.isidentifier():
            raise ChatTemplateError(f"chat_template_kwargs key {name!r} is not a template "
                                    "variable name")
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise ChatTemplateError(f"chat_template_kwargs may not set {name!r}: the server "
                                    "sets it (use the request's own field)")
    try:
        size = len(json.dumps(kwargs))
    except (TypeError, ValueError) as exc:
        raise ChatTemplateError(f"chat_template_kwargs must be JSON values: {exc}") from None
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise ChatTemplateError(f"chat_template_kwargs are {size} characters as JSON; at most "
                                f"{MAX_TEMPLATE_KWARGS_CHARS} are accepted")
    return kwargs


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, template: str, tokenizer: Any) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self._special_tokens = {
            name: getattr(tokenizer, name, None)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and string ``content``; assistant
        messages may have ``tool_calls``, tool messages ``tool_call_id``), with ``tools`` (the
        OpenAI tool dicts, as Hugging Face templates expect them) when given, and
        ``template_kwargs`` (checked by ``check_template_kwargs``) as extra variables."""
        extra = check_template_kwargs(template_kwargs) if template_kwargs else {}
        try:
            return self._template.render(
                **extra,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **self._special_tokens,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja errors (SecurityError from the sandbox too), bad types
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc

    def renders_tools(self) -> bool:
        """Whether the template shows the model the tools it is given (many do not)."""
        probe_tool = {"type": "function", "function": {
            "name": "octavo_probe_tool", "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        messages = [{"role": "user", "content": "probe"}]
        try:
            with_tools = self.render(messages, True, [probe_tool])
            return with_tools != self.render(messages, True, None)
        except ChatTemplateError:
            return False
