"""The tool parsers of ``tool_choice: "auto"`` (``--tool-call-parser``, vLLM's names): each reads a model family's
own way of writing calls from its streamed text. Text that is not a call stays content as written.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen2.5, Qwen3, Hermes);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``
  (Qwen3-Coder, Qwen3.5); each value is typed by the tool's parameter schema;
- ``llama3_json``: an output of ``{"name": ..., "parameters": ...}`` objects (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of calls, or ``NAME[ARGS]{...}`` per call (Mistral Small 3.2,
  Magistral); call ids of nine characters, as Mistral's templates demand;
- ``pythonic``: an output that is a Python list of calls, ``[f(x=1), g()]`` (Llama 3.2 and 4);
- ``openai``: gpt-oss's harmony messages to ``functions.NAME`` (read with ``--reasoning-parser gpt_oss``).
"""

from __future__ import annotations

import ast
import json
import re

from server.deltas import Delta, first_call_delta, held_back, mistral_call_id, named_call

_SEPARATORS = re.compile(r"[ \t\n\r;]*")  # between Llama 3's calls
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _TaggedCallsReader:
    """Content until a tag opens calls: text outside calls is content, except whitespace once a call was made."""

    START = ""

    def __init__(self, tools: tuple[dict, ...] = ()) -> None:
        self.tools = tools
        self.buffer = ""
        self.inside = False
        self.count = 0

    def _content_until_start(self, delta: Delta, final: bool) -> bool:
        """Move the content before ``START`` to ``delta``, and past ``START`` if it came (True)."""
        k = self.buffer.find(self.START)
        if k < 0:
            keep = 0 if final else held_back(self.buffer, self.START)
            self._content(delta, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self._content(delta, self.buffer[:k])
        self.buffer, self.inside = self.buffer[k + len(self.START) :], True
        return True

    def _content(self, delta: Delta, text: str) -> None:
        if self.count == 0 or text.strip():
            delta.content += text


class HermesCallsReader(_TaggedCallsReader):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text; a block that is not
    such JSON stays content as written."""

    START, END = "<tool_call>", "</tool_call>"

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        delta = Delta()
        while True:
            if not self.inside:
                if not self._content_until_start(delta, final):
                    return delta
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

    def _call(self, body: str) -> dict | None:
        call = named_call(self._parse(body), self.count)
        self.count += call is not None
        return call

    def _parse(self, body: str) -> object:
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return None


class Qwen3CoderCallsReader(HermesCallsReader):
    """Hermes's blocks with XML inside: ``<function=NAME>`` and a ``<parameter=KEY>`` element per argument, its
    value typed by the tool's schema (a string stays text; other types are read as JSON, or kept as text)."""

    _FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)

    def _parse(self, body: str) -> object:
        function = self._FUNCTION.search(body)
        if function is None:
            return None
        name = function.group(1)
        schema = next((t["function"].get("parameters") or {} for t in self.tools if t["function"]["name"] == name),
                      {})
        properties = schema.get("properties") or {}
        arguments = {key: _typed(value.removeprefix("\n").removesuffix("\n"), properties.get(key))
                     for key, value in self._PARAMETER.findall(function.group(2))}
        return {"name": name, "arguments": arguments}


def _typed(text: str, schema: object) -> object:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class Llama3JsonCallsReader:
    """Llama 3.x's JSON calls: an output that opens with ``{`` (or ``<|python_tag|>``) is one or more
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, each a call once it is complete; any other
    output is content. An output whose first object is not such a call is content as written, and so is what follows
    the last call that parsed."""

    TAG = "<|python_tag|>"

    def __init__(self, tools: tuple[dict, ...] = ()) -> None:
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
                call = named_call(value, self.count)
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


class MistralCallsReader(_TaggedCallsReader):
    """Content until ``[TOOL_CALLS]``; after it, calls as each completes: a JSON array of ``{"name", "arguments"}``,
    or ``NAME[ARGS]{...}`` (each later call after its own ``[TOOL_CALLS]``). Calls that do not parse are content."""

    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*")

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        delta = Delta()
        while True:
            if not self.inside and not self._content_until_start(delta, final):
                return delta
            calls, rest = self._calls(self.buffer)
            if calls is None:  # unfinished: wait, or at the end keep it as written
                if final:
                    self._content(delta, self.START + self.buffer)
                    self.buffer = ""
                return delta
            for value in calls:
                call = named_call(value, self.count, mistral_call_id())
                if call is not None:
                    delta.tool_calls.append(call)
                    self.count += 1
            self.buffer, self.inside = rest, False

    def _calls(self, text: str) -> tuple[list | None, str]:
        i = _WHITESPACE.match(text).end()
        try:
            if text[i : i + 1] == "[":
                value, end = _DECODER.raw_decode(text, i)
                return (value if isinstance(value, list) else None), text[end:]
            name = self._NAME.match(text, i)
            if name is None or not text.startswith(self.ARGS, name.end()):
                return None, text
            value, end = _DECODER.raw_decode(text, _WHITESPACE.match(text, name.end() + len(self.ARGS)).end())
            return [{"name": name.group(1), "arguments": value}], text[end:]
        except json.JSONDecodeError:
            return None, text


class PythonicCallsReader:
    """An output that opens with ``[`` (or ``<|python_start|>``) and is a Python list of calls with literal keyword
    arguments; the calls go out at the first ``]`` that completes such a list, and what follows it (but the closing
    ``<|python_end|>``) is content. An output whose list never completes is content as written."""

    TAGS = ("<|python_start|>", "<|python_end|>")

    def __init__(self, tools: tuple[dict, ...] = ()) -> None:
        self.buffer = ""
        self.calls: bool | None = None
        self.done = False
        self.checked = 0  # the buffer's characters whose closing brackets were tried

    def feed(self, text: str, final: bool) -> Delta:
        self.buffer += text
        if self.calls is None:
            head = self.buffer.lstrip()
            if head.startswith(("[", self.TAGS[0])):
                self.calls = True
            elif self.TAGS[0].startswith(head) and not final:
                return Delta()
            else:
                self.calls = False
        if self.done:  # after the calls: content, less the end tag
            cut = len(self.buffer) - (0 if final else held_back(self.buffer, self.TAGS[1]))
            content, self.buffer = self.buffer[:cut].replace(self.TAGS[1], ""), self.buffer[cut:]
            return Delta(content=content)
        if not self.calls:
            content, self.buffer = self.buffer, ""
            return Delta(content=content)
        for end in range(self.checked, len(self.buffer)):  # every ']' in order, whatever the pieces were
            if self.buffer[end] != "]":
                continue
            calls = _python_calls(self.buffer[: end + 1].replace(self.TAGS[0], "").strip())
            if calls is not None:
                self.done, self.buffer = True, self.buffer[end + 1 :]
                delta = self.feed("", final)
                delta.tool_calls = [first_call_delta(i, name, args) for i, (name, args) in enumerate(calls)]
                return delta
        self.checked = len(self.buffer)
        if final:
            self.calls = False
            content, self.buffer = self.buffer, ""
            return Delta(content=content)
        return Delta()


def _python_calls(source: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g()]`` as (name, arguments as JSON) pairs, or None where it is not such a list."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            calls.append((ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not literals, or no JSON for them (a set)
            return None
    return calls


# --tool-call-parser: how "auto" reads calls from the text; each reader is made with the request's tools
# ("openai" reads inside the harmony reader: server/harmony.py)
TOOL_CALL_PARSERS = {"hermes": HermesCallsReader, "qwen3_coder": Qwen3CoderCallsReader,
                     "llama3_json": Llama3JsonCallsReader, "mistral": MistralCallsReader,
                     "pythonic": PythonicCallsReader, "openai": None}
