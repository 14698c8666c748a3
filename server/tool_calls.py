"""Tool calling on /v1/chat/completions: what each ``tool_choice`` asks of the engine, and how the generated text
becomes OpenAI ``tool_calls``, whole or streamed.

- ``none``: plain text. The ``tools`` still reach the chat template, as in vLLM.
- a named function: structured outputs hold the output to that function's parameter schema. The whole output is
  the call's arguments, streamed as they come.
- ``required``: structured outputs hold the output to a JSON array of one or more ``{"name", "parameters"}``
  objects, one per call (at most one without ``parallel_tool_calls``). Each call goes out once its object is
  complete.
- ``auto``: the model decides, and a tool parser reads its calls from the text. It needs ``--enable-auto-tool-choice
  --tool-call-parser P``: ``hermes`` reads ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, as Qwen2.5,
  Qwen3 and Hermes models write them; ``llama3_json`` reads an output that is ``{"name": ..., "parameters": ...}``
  objects, as Llama 3.1-3.3 write them.

Each choice's text goes through its own reader as it streams. A whole response feeds its text to one in one piece,
so both shapes say the same.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Protocol

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SEPARATORS = re.compile(r"[ \t\n\r;]*")  # between Llama 3's calls
_DECODER = json.JSONDecoder()


@dataclasses.dataclass
class Delta:
    """What a piece of generated text adds to a chat message: content, and tool calls in OpenAI's streamed shape
    (an ``index`` each; ``id``, ``type`` and ``name`` only in a call's first delta)."""

    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)


class ToolCallReader(Protocol):
    def feed(self, text: str, final: bool) -> Delta: ...


def _first_delta(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class NamedCallReader:
    """The whole output is one call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str, final: bool) -> Delta:
        if not self.started:
            self.started = True
            return Delta(tool_calls=[_first_delta(0, self.name, text)])
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
            calls.append(_first_delta(self.count, value["name"], _arguments(value["parameters"])))
            self.count += 1
        if final and self.count == 0:  # cut short (max_tokens) before its first call was complete
            return Delta(content=self.buffer)
        return Delta(tool_calls=calls)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesCallsReader:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text. Text outside them
    is content, except whitespace once a call was made; a block that is not such JSON stays content as written."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False
        self.count = 0

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        delta = Delta()
        while True:
            if not self.inside:
                k = self.buffer.find(self.START)
                if k < 0:
                    keep = 0 if final else _held_back(self.buffer, self.START)
                    self._content(delta, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return delta
                self._content(delta, self.buffer[:k])
                self.buffer = self.buffer[k + len(self.START) :]
                self.inside = True
            else:
                k = self.buffer.find(self.END)
                if k < 0 and not final:
                    return delta
                body = self.buffer if k < 0 else self.buffer[:k]
                self.buffer = "" if k < 0 else self.buffer[k + len(self.END) :]
                self.inside = False
                call = self._call(body)
                if call is None:
                    self._content(delta, self.START + body + (self.END if k >= 0 else ""))
                else:
                    delta.tool_calls.append(call)

    def _content(self, delta: Delta, text: str) -> None:
        if self.count == 0 or text.strip():
            delta.content += text

    def _call(self, body: str) -> dict | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        call = _named_call(value, self.count)
        self.count += call is not None
        return call


def _named_call(value: object, index: int) -> dict | None:
    """A call's first delta from ``{"name": ..., "arguments" (or "parameters"): ...}``, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _first_delta(index, value["name"], _arguments(arguments))


class Llama3JsonCallsReader:
    """Llama 3.x's JSON calls: an output that opens with ``{`` (or ``<|python_tag|>``) is one or more
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, each a call once it is complete; any other
    output is content. An output whose first object is not such a call is content as written, and so is what follows
    the last call that parsed."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.buffer = ""
        self.pos = 0  # where the next call may begin; in content, what was sent
        self.calls: bool | None = None  # undecided until the output's first characters show
        self.count = 0

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        if self.calls is None:
            head = self.buffer.lstrip()
            if head.startswith((self.TAG, "{")):
                self.calls = True
                self.pos = len(self.buffer) - len(head) + (len(self.TAG) if head.startswith(self.TAG) else 0)
            elif self.TAG.startswith(head) and not final:
                return Delta()  # only whitespace yet, or the tag's beginning
            else:
                self.calls = False
        if not self.calls:
            content, self.pos = self.buffer[self.pos :], len(self.buffer)
            return Delta(content=content)
        delta = Delta()
        while True:
            i = _SEPARATORS.match(self.buffer, self.pos).end()
            if i == len(self.buffer):
                return self._as_content() if final and self.count == 0 else delta  # (the tag alone)
            try:
                value, end = _DECODER.raw_decode(self.buffer, i)
                call = _named_call(value, self.count)
            except json.JSONDecodeError:  # unfinished, or not JSON
                if not final:
                    return delta
                call = None
            if call is None:
                if self.count == 0:  # no call made: the whole output is content
                    return self._as_content()
                delta.content += self.buffer[i:]
                self.pos = len(self.buffer)
                return delta
            delta.tool_calls.append(call)
            self.count += 1
            self.pos = end

    def _as_content(self) -> Delta:
        self.calls, self.pos = False, len(self.buffer)
        return Delta(content=self.buffer)

# --tool-call-parser: how "auto" reads calls from the text
TOOL_CALL_PARSERS = {"hermes": HermesCallsReader, "llama3_json": Llama3JsonCallsReader}


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

    def reader(self) -> ToolCallReader | None:
        if self.kind == "named":
            return NamedCallReader(self.name)
        if self.kind == "required":
            return RequiredCallsReader()
        return TOOL_CALL_PARSERS[self.parser]() if self.kind == "auto" else None

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


def whole_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """A finished choice's content and tool calls (without the stream's ``index``)."""
    reader = plan.reader()
    if reader is None:
        return text, []
    delta = reader.feed(text, final=True)
    calls = [{k: v for k, v in call.items() if k != "index"} for call in delta.tool_calls]
    return (delta.content or None) if calls else delta.content, calls
