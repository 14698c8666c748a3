"""Serves /v1/completions and /v1/chat/completions over the async engine, whole or streamed (SSE)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from engine.output_processor import RequestState
from engine.sampling_params import SamplingParams
from engine.structured_output import check_grammar
from server.async_engine import AsyncEngine, Choice, EngineDeadError, RequestRejectedError
from server.formats import ChatFormat, CompletionFormat, TokenText, usage
from server.protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice
from server.tool_calls import ToolPlan, plan_tools, whole_message

DISCONNECT_POLL_S = 0.05
# apply_chat_template's own parameters: chat_template_kwargs may not reach them
_TEMPLATE_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}
OpenAIRequest = CompletionRequest | ChatCompletionRequest
ResponseFormat = CompletionFormat | ChatFormat


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int]


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, served_model_name: str,
                 max_waiting_requests: int, tool_call_parser: str | None = None) -> None:
        """``tool_call_parser``: how ``tool_choice`` "auto" reads calls from the text; None refuses "auto"."""
        self.engine = engine
        self.tool_call_parser = tool_call_parser
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_in_flight = engine.info.max_num_seqs + max_waiting_requests
        token_text = TokenText(tokenizer)
        self.completion_format = CompletionFormat(token_text)
        self.chat_format = ChatFormat(token_text)

    # ---- request checks -------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.served_model_name}`.",
                           param="model", code="model_not_found")

    def _admit(self, num_choices: int) -> None:
        if self.engine.dead_reason is not None:
            raise APIError(503, f"the engine is not running: {self.engine.dead_reason}")
        if self.engine.num_in_flight + num_choices > self.max_in_flight:
            raise APIError(429, f"the server is at capacity ({self.engine.num_in_flight} requests in flight); "
                                "retry shortly", headers={"Retry-After": "1"})

    def _validate(self, prompts: list[Prompt], params: SamplingParams) -> None:
        for prompt in prompts:
            try:
                self.engine.info.limits.validate(prompt.token_ids, params)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=e.param) from None

    async def _check_grammar(self, body: OpenAIRequest, params: SamplingParams) -> None:
        """Parse the request's grammar here, off the event loop, so a bad one is a 400 before any stream starts
        (the engine compiles its token masks)."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(check_grammar, params.structured_outputs)
        except ValueError as e:
            if body.structured_outputs is not None:
                param = "structured_outputs"
            else:
                param = "response_format" if body.response_format is not None else "tools"
            raise APIError(400, str(e), param=param) from None

    def _prompt_text(self, prompt: Prompt) -> str:
        """What ``echo`` repeats: the prompt as sent, or its token ids decoded."""
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _choices(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> list[Choice]:
        choices = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                index = i * params.n + j
                choices.append(Choice(f"{request_id}-{index}", prompt.token_ids, params.for_sample(j), index))
        return choices

    # ---- /v1/completions ------------------------------------------------------------------------------------------
    def completion_prompts(self, body: CompletionRequest) -> list[Prompt]:
        p = body.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "prompt must not be empty", param="prompt")
                prompts.append(Prompt(item, self.tokenizer.encode(item)))
            else:
                prompts.append(Prompt(None, list(item)))
        return prompts

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompts = self.completion_prompts(body)
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = _sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs)
        return await self._serve(body, raw, "cmpl", prompts, params, self.completion_format, body.logprobs,
                                 echo=body.echo)

    # ---- /v1/chat/completions -------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        try:
            plan = plan_tools(tools, choice, body.parallel_tool_calls, self.tool_call_parser)
        except ValueError as e:  # the message opens with the field at fault
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
        prompt = render_chat(self.tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                             body.chat_template_kwargs, tools)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(body, max_tokens, num_logprobs, None)
        grammar = plan.structured_outputs()
        if grammar is not None:
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice {plan.kind!r} holds the output to the tools' schemas: it cannot be "
                                    "combined with response_format or structured_outputs", param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=grammar)
        if plan.kind == "auto":  # a parser's tags may be special tokens: keep them in the text it reads
            params = dataclasses.replace(params, skip_special_tokens=False)
        return await self._serve(body, raw, "chatcmpl", [prompt], params, self.chat_format, num_logprobs,
                                 tools=plan if plan.kind != "none" else None)

    # ---- shared -------------------------------------------------------------------------------------------------
    async def _serve(self, body: OpenAIRequest, raw: Request, prefix: str, prompts: list[Prompt],
                     params: SamplingParams, fmt: ResponseFormat, num_logprobs: int | None,
                     echo: bool = False, tools: ToolPlan | None = None) -> Response:
        """``tools``: how a chat's text becomes tool calls (None: plain content)."""
        self._validate(prompts, params)
        await self._check_grammar(body, params)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        choices = self._choices(request_id, prompts, params)
        self._admit(len(choices))
        created = int(time.time())
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        header = {"id": request_id, "created": created, "model": self.served_model_name}
        if body.stream:
            stream = self._stream(header, choices, prompts, fmt, num_logprobs, echo, body.include_usage,
                                  num_prompt_tokens, tools)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        states = await self._collect(choices, raw)
        out_choices = []
        for state in sorted(states, key=lambda s: s.index):
            prompt = prompts[state.index // params.n]
            text, logprobs = state.text, None
            token_ids = list(state.token_ids)
            entries: list = list(state.logprobs or [])
            if echo:
                text = self._prompt_text(prompt) + text
                token_ids = prompt.token_ids + token_ids
                entries = list(state.prompt_logprobs or [None] * len(prompt.token_ids)) + entries
            if num_logprobs is not None:
                logprobs = fmt.logprobs(token_ids, entries, num_logprobs, 0)
            if tools is None:
                out_choices.append(fmt.choice(state.index, text, logprobs, state.finish_reason, state.stop_reason))
                continue
            content, calls = whole_message(tools, text)
            finish = tools.finish_reason(state.finish_reason, bool(calls))
            out_choices.append(fmt.choice(state.index, content, logprobs, finish, state.stop_reason, calls))
        return JSONResponse({**header, "object": fmt.object, "choices": out_choices,
                             "usage": usage(num_prompt_tokens, states, params.n)})

    async def _collect(self, choices: list[Choice], raw: Request) -> list[RequestState]:
        finished: dict[int, RequestState] = {}

        async def consume() -> None:
            async with aclosing(self.engine.generate(choices)) as states:
                async for state in states:
                    if state.finished:
                        finished[state.index] = state

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()  # aborts the engine requests in generate()'s cleanup
                    await asyncio.gather(task, return_exceptions=True)
                    raise APIError(499, "client disconnected")
            task.result()
        except RequestRejectedError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not running: {e}") from None
        finally:
            if not task.done():
                task.cancel()
        return list(finished.values())

    async def _stream(self, header: dict, choices: list[Choice], prompts: list[Prompt], fmt: ResponseFormat,
                      num_logprobs: int | None, echo: bool, include_usage: bool,
                      num_prompt_tokens: int, tools: ToolPlan | None) -> AsyncIterator[str]:
        chunk_header = {**header, "object": fmt.chunk_object}
        readers = {c.index: tools.reader() for c in choices} if tools is not None else {}
        called: set[int] = set()
        sent_text = dict.fromkeys((c.index for c in choices), 0)
        sent_tokens = dict.fromkeys(sent_text, 0)
        text_offset = dict.fromkeys(sent_text, 0)
        states: dict[int, RequestState] = {}
        n = len(choices) // len(prompts)
        extra = {"usage": None} if include_usage else {}

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            # NOTE: a chat choice's first chunk (with the role) goes out with its first token, not before, so a
            # client's time to first chunk is a true time to first token.
            first_chunk = {c.index for c in choices} if isinstance(fmt, ChatFormat) else set()
            if echo:
                for c in choices:
                    prompt = prompts[c.index // n]
                    text = self._prompt_text(prompt)
                    text_offset[c.index] = len(text)
                    yield event({**chunk_header, "choices": [fmt.chunk_choice(c.index, text, None, None, None)],
                                 **extra})
            async with aclosing(self.engine.generate(choices)) as updates:
                async for state in updates:
                    i = state.index
                    states[i] = state
                    end = state.detokenizer.stable_text_end(state.finished)
                    text = state.text[sent_text[i] : end]
                    new_ids = state.token_ids[sent_tokens[i] :]
                    # NOTE: a token whose text is held back (half a UTF-8 character, a possible stop string) still
                    # gets its chunk, with empty text, as vLLM sends it: one chunk per token keeps a client's
                    # inter-token timing honest instead of merging two tokens' gaps into one.
                    if not text and not new_ids and not state.finished and i not in first_chunk:
                        continue
                    logprobs = None
                    if num_logprobs is not None and new_ids:
                        entries = state.logprobs[sent_tokens[i] :]
                        logprobs = fmt.logprobs(new_ids, entries, num_logprobs, text_offset[i])
                        text_offset[i] += sum(len(fmt.token_text(t)) for t in new_ids)
                    sent_text[i], sent_tokens[i] = end, len(state.token_ids)
                    finish = state.finish_reason if state.finished else None
                    stop_reason = state.stop_reason if finish else None
                    calls: list[dict] = []
                    if readers:
                        delta = readers[i].feed(text, state.finished)
                        text, calls = delta.content, delta.tool_calls
                        if calls:
                            called.add(i)
                        finish = tools.finish_reason(finish, i in called)
                    chat_only = {"first": True} if i in first_chunk else {}  # both empty for a completion
                    if calls:
                        chat_only["tool_calls"] = calls
                    first_chunk.discard(i)
                    choice = fmt.chunk_choice(i, text, logprobs, finish, stop_reason, **chat_only)
                    yield event({**chunk_header, "choices": [choice], **extra})
            if include_usage:
                total = usage(num_prompt_tokens, list(states.values()), n)
                yield event({**chunk_header, "choices": [], "usage": total})
        except (RequestRejectedError, EngineDeadError) as e:
            status = 400 if isinstance(e, RequestRejectedError) else 503
            yield event(APIError(status, str(e)).body())
        yield "data: [DONE]\n\n"


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, object] | None = None,
                tools: list[dict] | None = None) -> Prompt:
    """The conversation through the model's chat template. ``template_kwargs`` reach the template as variables
    (e.g. Qwen3's ``enable_thinking``); none may stand for one of apply_chat_template's own arguments."""
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "continue_final_message continues the last message: it needs add_generation_prompt "
                            "false", param="continue_final_message")
    reserved = sorted(set(template_kwargs or ()) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    conversation = [m.for_template() for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools or None,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # a template may refuse a conversation (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))


def _sampling_params(body: OpenAIRequest, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
                     ) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:
        message = str(e)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None
