"""Reasoning parsers (``--reasoning-parser``, vLLM's names): how a reasoning model's thinking is told apart from its
answer, so that a chat message carries the thinking as ``reasoning_content`` and only the answer as ``content`` (and
tool calls and structured outputs are read from the answer alone).

- ``qwen3``: ``<think>...</think>``. Thinking when the prompt opened a block it did not close (Qwen3-Thinking's and
  Qwen3.5's templates) or the output opens one (Qwen3 writes ``<think>`` itself); a prompt that closed its block
  (``enable_thinking: false``) or an output that starts otherwise is all answer.
- ``deepseek_r1``: the same markers, but the output is thinking until ``</think>`` unless the prompt closed the
  block: DeepSeek-R1's template opens it, and its distills were trained to write only the close.
- ``gpt_oss``: OpenAI's harmony channels (server/harmony.py): ``analysis`` is the thinking, ``final`` the answer.

Each parser also names its markers as token ids, for the engine (``ThinkingParams``): a thinking budget or deadline
is kept by forcing the end marker, and a grammar holds the answer only. The text readers and the engine follow the
same rule for where thinking starts, from the same prompt.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from engine.sampling_params import ThinkingParams
from server.deltas import Delta, TextReader, held_back
from server.harmony import HarmonyReader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str  # the text that opens the thinking
    end: str  # the text that closes it (for the engine: the tokens forced at a bound)
    thinking_by_default: bool  # the output is thinking unless the prompt closed the block (deepseek_r1)
    special_tokens: bool = False  # the markers are special tokens: the text must keep them (skip_special_tokens off)

    def thinking_params(self, tokenizer: PreTrainedTokenizerBase, max_tokens: int | None = None,
                        deadline_ms: float | None = None) -> ThinkingParams:
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        return ThinkingParams(tuple(encode(self.start)), tuple(encode(self.end)), max_tokens, deadline_ms)

    def prompt_phase(self, prompt_text: str) -> bool | None:
        """Whether the output starts thinking (True), answering (False), or may open a block (None)."""
        opened, closed = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        return True if opened > closed else False if closed >= 0 else None

    def reader(self, prompt_text: str, tool_calls: bool = False) -> TextReader:
        """``tool_calls``: the reader also reads the model's own tool calls (harmony's, where it has them)."""
        if self.name == "gpt_oss":
            return HarmonyReader(tool_calls)
        return ThinkTagsReader(self.start, self.end, self.prompt_phase(prompt_text), self.thinking_by_default)


class ThinkTagsReader:
    """Splits streamed text at the thinking markers: ``feed`` gives each piece's reasoning and content. Whole and
    streamed agree: a marker's beginning at the end of a piece is held back until the next shows what it is."""

    def __init__(self, start: str, end: str, thinking: bool | None, by_default: bool = False) -> None:
        """``thinking``: as the prompt left it (None: the output decides); ``by_default``: an output that does
        not open a block is thinking all the same (until the end marker)."""
        self.start, self.end = start, end
        self.thinking = thinking
        self.by_default = by_default
        self.buffer = ""
        self.done = False  # the (first) block is closed: the rest is answer

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        delta = Delta()
        if self.thinking is None:
            head = self.buffer.lstrip()
            if head.startswith(self.start):
                self.thinking, self.buffer = True, head[len(self.start) :]
            elif self.start.startswith(head) and not final:
                return delta  # whitespace, or the marker's beginning, so far
            else:
                self.thinking = self.by_default
        if self.thinking and not self.done:
            k = self.buffer.find(self.end)
            if k < 0:
                cut = len(self.buffer) - (0 if final else held_back(self.buffer, self.end))
                delta.reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return delta
            delta.reasoning, self.buffer, self.done = self.buffer[:k], self.buffer[k + len(self.end) :], True
        delta.content, self.buffer = self.buffer, ""
        return delta


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>", thinking_by_default=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>", thinking_by_default=True),
    "gpt_oss": ReasoningParser("gpt_oss", "<|channel|>analysis<|message|>",
                               "<|end|><|start|>assistant<|channel|>final<|message|>", thinking_by_default=False,
                               special_tokens=True),
}
