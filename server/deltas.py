"""What a piece of generated text adds to a chat message (``Delta``), and the helpers every reader of calls and
thinking shares: a call's first streamed delta, its arguments as JSON text, and how much of a text's end to hold
back while it could still begin a tag."""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
import uuid
from typing import Protocol


@dataclasses.dataclass
class Delta:
    """Content, thinking, and tool calls in OpenAI's streamed shape (an ``index`` each; ``id``, ``type`` and
    ``name`` only in a call's first delta)."""

    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)
    reasoning: str = ""  # a reasoning model's thinking (server/reasoning.py)


class TextReader(Protocol):
    """Reads one choice's text as it streams; ``final`` with its last piece. A whole response feeds its text in one
    piece, so both shapes say the same."""

    def feed(self, text: str, final: bool) -> Delta: ...


def first_call_delta(index: int, name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"index": index, "id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def mistral_call_id() -> str:
    """Mistral's templates take call ids of exactly nine letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def call_arguments(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def named_call(value: object, index: int, call_id: str | None = None) -> dict | None:
    """A call's first delta from ``{"name": ..., "arguments" (or "parameters"): ...}``, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return first_call_delta(index, value["name"], call_arguments(arguments), call_id)


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
