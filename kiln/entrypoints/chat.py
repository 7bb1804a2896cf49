"""Chat messages: checked, then rendered through the tokenizer's chat template.

Messages follow the OpenAI shape: ``{"role": ..., "content": ...}`` where content
is a string or a list of ``{"type": "text", "text": ...}`` parts. Every error
names the message index and the field, before anything is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ROLES", "render_chat", "validate_messages"]

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
        if "content" not in m or m["content"] is None:
            raise ValueError(f"{where}.content is missing")
        out.append({**m, "content": _content_text(m["content"], where)})
    return out


def render_chat(tokenizer: Any, messages: Any, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template and
    the assistant's generation prompt. The rendered text carries its own special
    tokens, so it is encoded without adding more."""
    checked = validate_messages(messages)
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and the model has none")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; use generate() with a plain prompt")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "add_generation_prompt", "conversation"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {reserved!r}")
    text = tokenizer.apply_chat_template(checked, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
