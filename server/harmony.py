"""gpt-oss's output in OpenAI's harmony format, read as a chat message: the ``analysis`` channel is the thinking,
``final`` the answer, and a message addressed ``to=functions.NAME`` a tool call (``--reasoning-parser gpt_oss``,
with ``--tool-call-parser openai`` for the calls, as vLLM names them).

The output after the template's ``<|start|>assistant`` is a run of messages, each
``<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>json]<|message|>BODY`` closed by ``<|end|>``, ``<|call|>`` or
``<|return|>``, the next opening with ``<|start|>assistant`` (the recipient may also stand before ``<|channel|>``).
A ``commentary`` message without a recipient is a preamble the user sees: content. An output that does not open with
a harmony header is content as written.
"""

from __future__ import annotations

import re

from server.deltas import Delta, first_call_delta, held_back

MESSAGE = "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_OPENINGS = ("<|channel|>", "<|start|>")


class HarmonyReader:
    def __init__(self, tool_calls: bool) -> None:
        """``tool_calls``: messages to ``functions.NAME`` become calls (else their text is content)."""
        self.tool_calls = tool_calls
        self.buffer = ""
        self.in_body = False
        self.plain: bool | None = None  # the output is not harmony at all (None: not known yet)
        self.channel = ""
        self.function: str | None = None  # the body's recipient function, if it is a call
        self.arguments = ""
        self.count = 0

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        delta = Delta()
        if self.plain is None:
            head = self.buffer.lstrip()
            if any(head.startswith(o) for o in _OPENINGS):
                self.plain = False
            elif any(o.startswith(head) for o in _OPENINGS) and not final:
                return delta
            else:
                self.plain = True
        if self.plain:
            delta.content, self.buffer = self.buffer, ""
            return delta
        while True:
            if not self.in_body:
                k = self.buffer.find(MESSAGE)
                if k < 0:
                    if final:
                        self.buffer = ""  # a header cut short says nothing
                    return delta
                self._open(self.buffer[:k])
                self.buffer = self.buffer[k + len(MESSAGE) :]
            ends = [(k, t) for t in TERMINATORS if (k := self.buffer.find(t)) >= 0]
            if not ends:
                keep = 0 if final else max(held_back(self.buffer, t) for t in TERMINATORS)
                self._body(delta, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                if final:
                    self._close(delta)
                return delta
            k, terminator = min(ends)
            self._body(delta, self.buffer[:k])
            self._close(delta)
            # NOTE: <|start|> opens the next message's header: it stays, the header parser skips it
            self.buffer = self.buffer[k + (0 if terminator == "<|start|>" else len(terminator)) :]

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else ""
        name = recipient.group(1) if recipient else None
        self.function = name.removeprefix("functions.") if self.tool_calls and name else None
        self.arguments = ""
        self.in_body = True

    def _body(self, delta: Delta, text: str) -> None:
        if self.function is not None:
            self.arguments += text
        elif self.channel == "analysis":
            delta.reasoning += text
        else:
            delta.content += text

    def _close(self, delta: Delta) -> None:
        if self.in_body and self.function is not None:
            delta.tool_calls.append(first_call_delta(self.count, self.function, self.arguments.strip()))
            self.count += 1
        self.in_body = False
