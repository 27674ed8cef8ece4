"""Render a model's Jinja chat template the way transformers does, so prompts match the model's training."""

import copy
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllmpy.tokenizer.errors import ChatTemplateError

# Keys the renderer itself supplies; letting chat_template_kwargs set them would silently fight it.
RESERVED_KWARGS = frozenset(
    {"messages", "tools", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message"}
)

# Appended to the final message to find where it ends in the rendered prompt; the trailing space
# tells whether the template trims message text.
_CONTINUE_MARK = "VLLMPY_CONTINUE_FINAL_MESSAGE "


class _GenerationBlock(Extension):
    """`{% generation %}` marks assistant text for training masks; at inference it renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    """transformers' tojson: plain json.dumps, without Jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict] | None,
    special_tokens: dict[str, str],
    extra: dict[str, Any] | None,
) -> str:
    """Render `messages`; only keys someone sends become template variables, so `x is undefined` works."""
    extra = extra or {}
    for key in extra:
        if key in RESERVED_KWARGS:
            raise ChatTemplateError(f"chat_template_kwargs may not set {key!r}: the renderer supplies it")
    messages = copy.deepcopy(messages)
    if continue_final_message:
        _mark_final_message(messages)
        # Everything after the final message is cut, so a generation prompt could only leak into it.
        add_generation_prompt = False
    variables: dict[str, Any] = {
        **special_tokens,
        **extra,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
    }
    if tools is not None:
        variables["tools"] = tools
    try:
        rendered = _compile(template).render(**variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    return _cut_after_final_message(rendered) if continue_final_message else rendered


def _mark_final_message(messages: list[dict]) -> None:
    """Append the mark to the final message's text (its last text part, for a list of parts)."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs a final message to continue")
    content = messages[-1].get("content")
    if isinstance(content, str):
        messages[-1]["content"] = content + _CONTINUE_MARK
        return
    for part in reversed(content if isinstance(content, list) else []):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            part["text"] += _CONTINUE_MARK
            return
    raise ChatTemplateError("continue_final_message needs text in the final message to continue")


def _cut_after_final_message(rendered: str) -> str:
    """Drop what the template writes after the final message, leaving that message open."""
    at = rendered.rfind(_CONTINUE_MARK.rstrip())
    if at < 0:
        raise ChatTemplateError("the chat template does not render the final message, so it cannot be continued")
    if rendered.startswith(_CONTINUE_MARK, at):
        return rendered[:at]
    # The template trimmed the message, so trailing whitespace of the original text went too.
    return rendered[:at].rstrip()
