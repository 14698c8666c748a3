"""OpenAI Responses API request bodies (``POST /v1/responses``), and their translation into a chat request: the
Responses API is served by the chat pipeline (template, tools, reasoning, structured outputs), so it behaves
exactly as chat does. Unknown fields, and known ones this server does not do, are a 400 naming them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.errors import InvalidRequestError
from server.protocol import MAX_LOGPROBS, ChatCompletionRequest, ChatMessage, JSONSchemaFormat, _Strict

# A chat request's fields as the Responses request names them, for a 400 that names the field the client sent
RESPONSES_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
                    "reasoning_effort": "reasoning"}


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier turn's thinking: read, and left out of the prompt (as the chat templates drop it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def for_chat(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    # vLLM's and Harpoon's own, as on chat
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    thinking_token_budget: int | None = Field(default=None, ge=0)
    thinking_deadline_ms: float | None = Field(default=None, gt=0)
    chat_template_kwargs: dict[str, object] | None = None

    @model_validator(mode="after")
    def _input_not_empty(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise InvalidRequestError("input must not be empty", "input")
        return self

    def chat_messages(self, history: list[dict]) -> list[ChatMessage]:
        """The conversation as chat messages: the instructions first (a system message), an earlier response's
        conversation (``history``, chat messages as dicts), then this input; consecutive function calls become one
        assistant message."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [dict(m) for m in history]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else {}
                if last.get("role") == "assistant" and last.get("tool_calls") and not last.get("content"):
                    last["tool_calls"] = [*last["tool_calls"], call]
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        return [ChatMessage.model_validate(m) for m in messages]

    def chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this one is served as (``stream`` is the Responses stream's own business)."""
        fields: dict[str, object] = {
            "messages": [m.model_dump(exclude_none=True) for m in messages], "max_completion_tokens":
            self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "parallel_tool_calls": self.parallel_tool_calls, "thinking_token_budget": self.thinking_token_budget,
            "thinking_deadline_ms": self.thinking_deadline_ms, "chat_template_kwargs": self.chat_template_kwargs,
            "user": self.user,
        }
        if self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ()):
            fields |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            fields["tools"] = [t.for_chat() for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None and (self.tools or self.tool_choice != "none"):
            fields["tool_choice"] = self.tool_choice
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_schema" and (fmt.schema_ is None or fmt.name is None):
                raise InvalidRequestError("text.format json_schema needs name and schema", "text")
            schema = JSONSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict) \
                if fmt.type == "json_schema" else None
            fields["response_format"] = {"type": fmt.type, "json_schema": schema.model_dump(by_alias=True)
                                         if schema else None}
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
