"""OpenAI request bodies. Unknown or unsupported fields are rejected by name (400), never silently ignored."""

from __future__ import annotations

import functools
import json
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

# The most samples one request may ask for (n, best_of): OpenAI's limit. A request's choices also count against the
# server's admission limit (--max-waiting-requests beyond the running batch).
MAX_N = 128


class APIError(Exception):
    """An error answered with OpenAI's envelope: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the top-level field (a validator's own error names its
    field itself)."""
    error = e.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return APIError(400, str(cause), param=cause.param)
    param = str(error["loc"][0]) if error["loc"] else None
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        message = f"unsupported parameter: '{where}' is not supported by this server"
    else:
        message = f"{where}: {error['msg']}" if where else error["msg"]
    return APIError(400, message, param=param)


class _Strict(BaseModel):
    """JSON types as OpenAI's API gives them: no coercion (``"max_tokens": "2"`` is a 400), no unknown fields, and
    ``null`` for a field that has a default means that default (``"n": null``, as OpenAI and vLLM take it). Validators
    raise InvalidRequestError, so a 400 names its field even where pydantic gives no location."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in _defaults_without_null(cls)}


@functools.cache
def _defaults_without_null(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` (by name and alias) that have a default but do not admit None."""
    names = set()
    for name, info in model.model_fields.items():
        if not info.is_required() and type(None) not in typing.get_args(info.annotation):
            names |= {name, info.alias or name}
    return frozenset(names)


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidRequestError("response_format: json_schema is given exactly when type is 'json_schema'",
                                      "response_format")
        if self.json_schema is not None and self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format: json_schema.schema is required", "response_format")
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, any JSON object, a regex, a choice, EBNF."""

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                                       choice=self.choice, grammar=self.grammar,
                                       disable_any_whitespace=self.disable_any_whitespace)


class _SamplingFields(_Strict):
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # SGLang's own fields, which its router (sglang-router: the compose profile "replicas", loadtest/replicas.py)
    # writes into every body it forwards: the values that ask for nothing are taken, the others are a 400.
    # separate_reasoning=false leaves a reasoning model's thinking in the content; stream_reasoning changes nothing.
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        return self

    @model_validator(mode="after")
    def _sglang_fields_ask_for_nothing(self) -> _SamplingFields:
        if self.no_stop_trim:
            raise InvalidRequestError("no_stop_trim=true is not supported: a stop string is trimmed from the output "
                                      "unless include_stop_str_in_output is true", "no_stop_trim")
        if self.return_hidden_states:
            raise InvalidRequestError("return_hidden_states=true is not supported by this server",
                                      "return_hidden_states")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """Raise InvalidRequestError naming the offending field. ``defaults``: the model's sampling values
        (generation_config.json) for the fields the request leaves out."""
        defaults = defaults or {}
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])

        def given(name: str, default: object) -> object:
            value = getattr(self, name)
            return defaults.get(name, default) if value is None else value

        return SamplingParams(
            n=self.n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
            top_k=given("top_k", 0), min_p=given("min_p", 0.0), seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, presence_penalty=given("presence_penalty", 0.0),
            frequency_penalty=given("frequency_penalty", 0.0),
            repetition_penalty=given("repetition_penalty", 1.0), logit_bias=bias, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(),
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise InvalidRequestError("response_format and structured_outputs cannot both be given",
                                      "response_format")
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # Samples generated per prompt, of which the n with the highest mean token logprob are returned (OpenAI's)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.stream and self.num_samples > self.n:
            raise InvalidRequestError("best_of greater than n cannot be streamed: the best are known at the end",
                                      "best_of")
        return self

    @property
    def num_samples(self) -> int:
        """Samples to generate per prompt."""
        return self.best_of or self.n


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As chat templates read a call: its arguments as an object where they parse as one."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    def for_template(self) -> dict:
        message: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def num_chars(self) -> int:
        """Characters of text this message brings to the prompt (its content, name and calls)."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text()) + len(self.name or "") + calls

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat template options
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, object] | None = None
    # Reasoning models (a server with --reasoning-parser): vLLM's thinking budget, Harpoon's thinking deadline (ms
    # from arrival), whether the message carries the thinking, and OpenAI's effort (passed to the template)
    thinking_token_budget: int | None = Field(default=None, ge=0)
    thinking_deadline_ms: float | None = Field(default=None, gt=0)
    include_reasoning: bool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, object] | None:
        """``chat_template_kwargs``, with ``reasoning_effort`` where given (gpt-oss's template reads it)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs is only allowed when logprobs is true", "top_logprobs")
        return self


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
