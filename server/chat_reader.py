"""How a chat choice's generated text becomes a message: the thinking split off first (a reasoning parser), then
tool calls read from the answer (the request's tool plan). One reader per choice, fed as the text streams; a whole
response feeds its text in one piece, so both shapes say the same."""

from __future__ import annotations

import dataclasses

from server.deltas import Delta, TextReader
from server.reasoning import ReasoningParser
from server.tool_calls import ToolPlan


class ChatTextReader:
    def __init__(self, reasoning: TextReader | None, tools: TextReader | None, show_reasoning: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.show_reasoning = show_reasoning

    def feed(self, text: str, final: bool) -> Delta:
        delta = self.reasoning.feed(text, final) if self.reasoning is not None else Delta(content=text)
        if not self.show_reasoning:
            delta.reasoning = ""
        if self.tools is not None:
            answer = self.tools.feed(delta.content, final)
            delta.content = answer.content
            delta.tool_calls += answer.tool_calls
        return delta


@dataclasses.dataclass(frozen=True)
class ChatReading:
    """A chat request's way of reading its choices' text: ``tools`` (None: no tools), ``reasoning`` (None: no
    reasoning parser, or the request asked for the thinking to stay in the content), and the rendered prompt, where
    the template may have opened the thinking."""

    tools: ToolPlan | None
    reasoning: ReasoningParser | None
    prompt_text: str = ""
    show_reasoning: bool = True  # the request's include_reasoning

    @property
    def plain(self) -> bool:
        return self.tools is None and self.reasoning is None

    def reader(self) -> ChatTextReader:
        harmony_calls = self.tools is not None and self.tools.kind == "auto" and self.tools.parser == "openai"
        reasoning = self.reasoning.reader(self.prompt_text, harmony_calls) if self.reasoning is not None else None
        return ChatTextReader(reasoning, self.tools.reader() if self.tools is not None else None, self.show_reasoning)

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """A finished choice's content, thinking and tool calls (without the stream's ``index``)."""
        delta = self.reader().feed(text, final=True)
        calls = [{k: v for k, v in call.items() if k != "index"} for call in delta.tool_calls]
        content = (delta.content or None) if calls else delta.content
        return content, delta.reasoning or None, calls

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        return self.tools.finish_reason(reason, called) if self.tools is not None else reason
