"""Serves OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) over the chat pipeline.

A request becomes a chat request (server/responses_protocol.py): the same template, tools, reasoning parser and
structured outputs. Its output is a list of items, each with an id: the thinking (``reasoning``, when a reasoning
parser is on), the answer (``message``) and the calls (``function_call``). Streamed, the items open, grow and close
through the Responses event sequence (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), every event numbered, and the last event holds the same response the whole request
returns.

``store`` (on by default, as OpenAI's) keeps a response and its conversation in memory, the latest
``max_stored`` of them, so a later request can continue it with ``previous_response_id`` (a tool round trip sends
only the calls' outputs). A response evicted or never stored is a 404 naming the field.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from engine.errors import InvalidRequestError
from engine.output_processor import RequestState
from engine.sampling_params import SamplingParams
from server.async_engine import Choice, EngineDeadError, RequestRejectedError
from server.deltas import Delta
from server.protocol import APIError, validation_error
from server.responses_protocol import RESPONSES_PARAMS, ResponsesRequest
from server.serving import OpenAIServing

DEFAULT_MAX_STORED = 1024
T = TypeVar("T")


def _renamed(e: APIError) -> APIError:
    """A chat error, naming the Responses field the client sent."""
    e.param = RESPONSES_PARAMS.get(e.param, e.param)
    return e


async def _as_responses(step: Awaitable[T]) -> T:
    try:
        return await step
    except APIError as e:
        raise _renamed(e) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Stored:
    response: dict
    messages: list[dict]  # the conversation through this response's output, as chat messages (no instructions)


@dataclass
class _Output:
    """A response's output items as they are built, streamed or whole."""

    items: list[dict] = field(default_factory=list)
    open_kind: str | None = None  # the item being written: "reasoning", "message", or None
    calls: dict[int, dict] = field(default_factory=dict)  # by the reader's call index

    def add(self, delta: Delta) -> list[tuple[str, dict]]:
        """Take a reader's delta; the events it makes, as (type, fields)."""
        events: list[tuple[str, dict]] = []
        for kind, text, event in (("reasoning", delta.reasoning, "response.reasoning_text.delta"),
                                  ("message", delta.content, "response.output_text.delta")):
            if not text:
                continue
            events += self._open(kind)
            item = self.items[-1]
            item["content"][0]["text"] += text
            where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
            events.append((event, {**where, "delta": text, **({"logprobs": []} if kind == "message" else {})}))
        for call in delta.tool_calls:
            if call["index"] not in self.calls:
                events += self._close()
                item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": ""}
                self.items.append(item)
                self.calls[call["index"]] = item
                events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}))
            item = self.calls[call["index"]]
            item["arguments"] += call["function"]["arguments"]
            events.append(("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": self.items.index(item), "delta": call["function"]["arguments"]}))
        return events

    def finish(self) -> list[tuple[str, dict]]:
        """Close what is open; an output with no message and no call gets an empty message, as OpenAI's has."""
        events = self._close()
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._open("message") + self._close()
        for item in self.calls.values():
            if item["status"] == "in_progress":
                item["status"] = "completed"
                index = self.items.index(item)
                events.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                         "arguments": item["arguments"]}))
                events.append(("response.output_item.done", {"output_index": index, "item": dict(item)}))
        return events

    def _open(self, kind: str) -> list[tuple[str, dict]]:
        if self.open_kind == kind:
            return []
        events = self._close()
        index = len(self.items)
        self.open_kind = kind
        if kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            self.items.append(item)
            return [*events, ("response.output_item.added", {"output_index": index, "item": _empty(item)})]
        item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        return [*events, ("response.output_item.added", {"output_index": index, "item": {**item, "content": []}}),
                ("response.content_part.added", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                                 "part": dict(item["content"][0])})]

    def _close(self) -> list[tuple[str, dict]]:
        kind, self.open_kind = self.open_kind, None
        if kind is None:
            return []
        index = len(self.items) - 1
        item = self.items[index]
        item["status"] = "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            events = [("response.reasoning_text.done", {**where, "text": part["text"]})]
        else:
            events = [("response.output_text.done", {**where, "text": part["text"], "logprobs": []}),
                      ("response.content_part.done", {**where, "part": dict(part)})]
        return [*events, ("response.output_item.done", {"output_index": index, "item": json.loads(json.dumps(item))})]

    def text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")

    def chat_message(self) -> dict:
        """The output as the assistant's chat message, for a later turn's prompt."""
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return {"role": "assistant", "content": self.text() or None, **({"tool_calls": calls} if calls else {})}


def _empty(item: dict) -> dict:
    return {**item, "content": [{**c, "text": ""} for c in item["content"]]}


def _reasoning_tokens(token_ids: list[int], params: SamplingParams, output: _Output) -> int:
    """Thinking tokens of an output: those before the end marker (all of them if it never closed)."""
    thinking = params.thinking
    if thinking is None or not any(i["type"] == "reasoning" for i in output.items):
        return 0
    end, start = list(thinking.end_ids), list(thinking.start_ids)
    stop = next((k for k in range(len(token_ids) - len(end) + 1) if token_ids[k : k + len(end)] == end),
                len(token_ids))
    return stop - (len(start) if token_ids[: len(start)] == start else 0)


class ResponsesServing:
    def __init__(self, chat: OpenAIServing, max_stored: int = DEFAULT_MAX_STORED) -> None:
        self.chat = chat
        self.max_stored = max_stored
        self.stored: collections.OrderedDict[str, _Stored] = collections.OrderedDict()

    def retrieve(self, response_id: str) -> dict:
        stored = self.stored.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id '{response_id}' (this server keeps the latest "
                                f"{self.max_stored} responses made with store true)", param="response_id")
        return stored.response

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.chat.check_model(body.model)
        self.chat.check_generative()
        history: list[dict] = []
        if body.previous_response_id is not None:
            stored = self.stored.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous response '{body.previous_response_id}' is not stored here (never "
                                    f"stored, or beyond the latest {self.max_stored})", param="previous_response_id")
            history = stored.messages
        try:
            messages = body.chat_messages(history)
            chat_body = body.chat_request(messages)
        except InvalidRequestError as e:
            raise _renamed(APIError(400, str(e), param=e.param)) from None
        except ValidationError as e:
            raise _renamed(validation_error(e)) from None
        prompt, params, reading = await _as_responses(self.chat.prepare_chat(chat_body))
        try:
            self.chat.validate([prompt], params)
        except APIError as e:
            raise _renamed(e) from None
        await _as_responses(self.chat.check_grammar(chat_body, params))
        response_id = _new_id("resp")
        choices = [Choice(response_id, prompt.token_ids, params, 0)]
        self.chat.admit(1)
        kept = messages[1:] if body.instructions else messages
        turn = _Turn(self, body, response_id, int(time.time()), len(prompt.token_ids), params,
                     [m.model_dump(exclude_none=True) for m in kept])
        if body.stream:
            return StreamingResponse(self._stream(turn, choices, reading.reader(), arrival),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": response_id})
        state = (await _as_responses(self.chat.collect(choices, raw, arrival)))[0]
        output = _Output()
        output.add(reading.reader().feed(state.text, final=True))
        output.finish()
        return JSONResponse(turn.done(state, output), headers={"X-Request-Id": response_id})

    async def _stream(self, turn: _Turn, choices: list[Choice], reader: object, arrival: float
                      ) -> AsyncIterator[str]:
        sequence = 0

        def event(kind: str, fields: dict) -> str:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        output = _Output()
        yield event("response.created", {"response": turn.header("in_progress")})
        yield event("response.in_progress", {"response": turn.header("in_progress")})
        sent = 0
        try:
            async with aclosing(self.chat.engine.generate(choices, arrival)) as updates:
                async for update in updates:
                    text, sent = update.state.text[sent : update.text_end], update.text_end
                    for kind, fields in output.add(reader.feed(text, update.finished)):
                        yield event(kind, fields)
                    if update.finished:
                        for kind, fields in output.finish():
                            yield event(kind, fields)
                        response = turn.done(update.state, output)
                        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                        yield event(kind, {"response": response})
        except RequestRejectedError as e:
            yield event("error", {"code": "invalid_request_error", "message": str(e), "param": e.param})
        except EngineDeadError as e:
            yield event("error", {"code": "server_error", "message": e.api_error().message, "param": None})


@dataclass
class _Turn:
    """One Responses request: what its response object says besides the output, and storing it when done."""

    serving: ResponsesServing
    body: ResponsesRequest
    response_id: str
    created_at: int
    num_prompt_tokens: int
    params: SamplingParams
    messages: list[dict]

    def header(self, status: str) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else \
            {"type": "text"}
        tool_choice = b.tool_choice.model_dump() if b.tool_choice is not None and not isinstance(b.tool_choice, str) \
            else b.tool_choice or ("auto" if b.tools else "none")
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.serving.chat.served_model_name, "output": [], "error": None, "incomplete_details": None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": self.params.temperature, "top_p": self.params.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or []], "tool_choice": tool_choice,
                "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
                "reasoning": b.reasoning.model_dump() if b.reasoning else {"effort": None, "summary": None},
                "text": {"format": fmt}, "store": b.store, "metadata": b.metadata or {}, "truncation": "disabled",
                "user": b.user, "usage": None}

    def done(self, state: RequestState, output: _Output) -> dict:
        complete = state.finish_reason != "length"
        num_output = len(state.token_ids)
        response = {**self.header("completed" if complete else "incomplete"), "output": output.items,
                    "incomplete_details": None if complete else {"reason": "max_output_tokens"},
                    "usage": {"input_tokens": self.num_prompt_tokens,
                              "input_tokens_details": {"cached_tokens": state.num_cached_tokens},
                              "output_tokens": num_output,
                              "output_tokens_details": {
                                  "reasoning_tokens": _reasoning_tokens(list(state.token_ids), self.params, output)},
                              "total_tokens": self.num_prompt_tokens + num_output}}
        if self.body.store:
            stored = self.serving.stored
            stored[self.response_id] = _Stored(response, [*self.messages, output.chat_message()])
            while len(stored) > self.serving.max_stored:
                stored.popitem(last=False)
        return response

