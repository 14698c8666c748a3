"""Tool calling on /v1/chat/completions: what each ``tool_choice`` asks of the engine, and how the generated text
becomes OpenAI ``tool_calls``, whole or streamed.

- ``none``: plain text. The ``tools`` still reach the chat template, as in vLLM.
- a named function: structured outputs hold the output to that function's parameter schema. The whole output is
  the call's arguments, streamed as they come.
- ``required``: structured outputs hold the output to a JSON array of one or more ``{"name", "parameters"}``
  objects, one per call (at most one without ``parallel_tool_calls``). Each call goes out once its object is
  complete.
- ``auto``: the model decides, and a tool parser reads its calls from the text. It needs ``--enable-auto-tool-choice
  --tool-call-parser P`` (server/tool_parsers.py).

Each choice's text goes through its own reader as it streams. A whole response feeds its text to one in one piece,
so both shapes say the same. With a reasoning parser the readers see the answer only (server/reasoning.py).
"""

from __future__ import annotations

import dataclasses
import json
import re

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams
from server.deltas import Delta, TextReader, call_arguments, first_call_delta
from server.tool_parsers import TOOL_CALL_PARSERS

_ANY_OBJECT = {"type": "object"}
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class NamedCallReader:
    """The whole output is one call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str, final: bool) -> Delta:
        if not self.started:
            self.started = True
            return Delta(tool_calls=[first_call_delta(0, self.name, text)])
        return Delta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])


class RequiredCallsReader:
    """The output is a JSON array of ``{"name", "parameters"}`` objects; each becomes a call once it is complete.
    The grammar guarantees a valid prefix, so an object that does not parse yet is only unfinished."""

    def __init__(self) -> None:
        self.buffer = ""
        self.pos = 0
        self.opened = False
        self.count = 0

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        calls = []
        while True:
            i = _WHITESPACE.match(self.buffer, self.pos).end()
            if i == len(self.buffer) or self.buffer[i] == "]":
                break
            if not self.opened or self.buffer[i] == ",":
                self.opened = True
                self.pos = i + 1
                continue
            try:
                value, self.pos = _DECODER.raw_decode(self.buffer, i)
            except json.JSONDecodeError:
                break
            calls.append(first_call_delta(self.count, value["name"], call_arguments(value["parameters"])))
            self.count += 1
        if final and self.count == 0:  # cut short (max_tokens) before its first call was complete
            return Delta(content=self.buffer)
        return Delta(tool_calls=calls)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """A chat request's tool choice, checked against its tools and the server's parser."""

    kind: str  # "none", "auto", "required" or "named"
    tools: tuple[dict, ...] = ()
    name: str | None = None
    parallel: bool = True
    parser: str | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        functions = {t["function"]["name"]: t["function"].get("parameters") or _ANY_OBJECT for t in self.tools}
        if self.kind == "named":
            return StructuredOutputsParams(json=functions[self.name])
        if self.kind != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in functions.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputsParams(json=array if self.parallel else {**array, "maxItems": 1})

    def reader(self) -> TextReader | None:
        """None where the text is plain content, or where another reader reads the calls (harmony's)."""
        if self.kind == "named":
            return NamedCallReader(self.name)
        if self.kind == "required":
            return RequiredCallsReader()
        parser = TOOL_CALL_PARSERS[self.parser] if self.kind == "auto" else None
        return parser(self.tools) if parser is not None else None

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call (auto, required); a named call ends with ``stop``."""
        return "tool_calls" if reason == "stop" and called and self.kind in ("auto", "required") else reason


def plan_tools(tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool,
               parser: str | None) -> ToolPlan:
    """Raise InvalidRequestError naming the field at fault; ``parser`` is the server's
    ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on, else None."""
    tools = tools or []
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise InvalidRequestError("tools must have distinct function names", "tools")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools and tool_choice != "none":
        raise InvalidRequestError("tool_choice needs tools", "tool_choice")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not among the tools",
                                      "tool_choice")
        return ToolPlan("named", tuple(tools), name, parallel)
    if tool_choice == "auto" and parser is None:
        raise InvalidRequestError('tool_choice "auto" (the default when tools are given) needs the server started '
                                  'with --enable-auto-tool-choice --tool-call-parser; pass tool_choice "required", '
                                  '"none" or a named function', "tool_choice")
    return ToolPlan(tool_choice, tuple(tools), None, parallel, parser if tool_choice == "auto" else None)
