"""Chat messages: checked, then rendered through the tokenizer's chat template.

Messages follow the OpenAI shape: ``{"role": ..., "content": ...}`` where content
is a string or a list of ``{"type": "text", "text": ...}`` parts. An assistant
message that called tools carries ``tool_calls`` and may have no content; the
calls' ``arguments`` (JSON text in the API) reach the template as objects, as
the templates of Qwen and Llama expect them (vLLM does the same). Every error
names the message index and the field, before anything is queued.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["ROLES", "render_chat", "validate_messages"]

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool", "developer")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}, got {part!r:.80}")
        texts.append(part["text"])
    return "".join(texts)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages with text content flattened to strings; ValueError naming
    ``messages[i]`` and the field for anything else."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        calls = _tool_calls(m["tool_calls"], where) if role == "assistant" and m.get("tool_calls") else None
        if m.get("content") is None:
            if calls is None:
                raise ValueError(f"{where}.content is missing")
            out.append({**m, "content": "", "tool_calls": calls})  # templates join content as a string
            continue
        out.append({**m, "content": _content_text(m["content"], where), **({"tool_calls": calls} if calls else {})})
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each call's arguments as an
    object. Arguments that are not valid JSON become ``{}`` with a warning, as
    vLLM does: failing here would fail every later turn of the conversation."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                             f"'arguments': str}}}}, got {call!r:.80}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                logger.warning("%s.tool_calls[%d].function.arguments is not valid JSON; the template gets {}", where, j)
                args = {}
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def render_chat(tokenizer: Any, messages: Any, chat_template_kwargs: dict[str, Any] | None = None, *,
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                add_generation_prompt: bool | None = None, continue_final_message: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (``chat_template``,
    else the tokenizer's) and the assistant's generation prompt, with ``tools``
    (OpenAI's function definitions) offered to the template as ``tools``. The
    rendered text carries its own special tokens, so it is encoded without
    adding more.

    ``continue_final_message`` leaves the last message open (no end-of-turn
    after it), so that the answer continues it: an assistant reply begun by
    the caller. It renders no generation prompt; ``add_generation_prompt``
    (default: unless continuing) may not also be true, as vLLM refuses it."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: a continued "
                         "message is not followed by a new turn")
    checked = validate_messages(messages)
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and the model has none")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the model's tokenizer has no chat template; use generate() with a plain prompt, "
                         "or give one (--chat-template)")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "add_generation_prompt", "continue_final_message", "conversation", "chat_template"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {reserved!r}")
    if tools:
        named = template.values() if isinstance(template, dict) else [template]  # transformers' named templates
        if not any("tools" in t for t in named):
            logger.warning("the chat template does not mention 'tools': the model will not see the tools offered")
        kwargs["tools"] = tools
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            checked, tokenize=False, add_generation_prompt=not continue_final_message if add_generation_prompt is None
            else add_generation_prompt, continue_final_message=continue_final_message, chat_template=chat_template,
            **kwargs)
    except TemplateError as e:  # the template's own raise_exception, or a template that cannot render these
        raise ValueError(f"the chat template refused the messages: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
