"""Serves /v1/completions and /v1/chat/completions over the async engine, whole or streamed (SSE)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from engine.inputs import fan_out
from engine.output_processor import RequestState
from engine.sampling_params import SamplingParams
from engine.structured_output import check_grammar
from server.async_engine import AsyncEngine, Choice, EngineDeadError, RequestRejectedError
from server.chat_reader import ChatReading
from server.formats import ChatFormat, CompletionFormat, TokenText, usage
from server.prompts import Prompt, PromptBuilder
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from server.reasoning import REASONING_PARSERS
from server.tool_calls import plan_tools

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ThinkingDefaults:
    """The server's bounds on thinking (--thinking-token-budget, --thinking-deadline-ms) for requests that set none."""

    max_tokens: int | None = None
    deadline_ms: float | None = None

DISCONNECT_POLL_S = 0.05
OpenAIRequest = CompletionRequest | ChatCompletionRequest
ResponseFormat = CompletionFormat | ChatFormat


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, served_model_name: str,
                 max_waiting_requests: int, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 thinking: ThinkingDefaults | None = None, sampling_defaults: dict | None = None) -> None:
        """``tool_call_parser``: how ``tool_choice`` "auto" reads calls from the text; None refuses "auto".
        ``reasoning_parser``: how a reasoning model's thinking is told from its answer (None: it is content);
        ``thinking``: the server's bounds on it where a request sets none. ``sampling_defaults``: the model's
        sampling values (generation_config.json) for the fields a request leaves out."""
        self.sampling_defaults = sampling_defaults or {}
        self.engine = engine
        self.tool_call_parser = tool_call_parser
        self.reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser is not None else None
        # the parser's markers as token ids, encoded once; a request's bounds are put on them
        self._thinking_markers = self.reasoning.thinking_params(tokenizer) if self.reasoning is not None else None
        self.thinking = thinking or ThinkingDefaults()
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer, engine.info.limits.max_model_len)
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

    def check_generative(self) -> None:
        if self.engine.info.pooling is not None:
            raise APIError(400, "this server's model is an embedding model: it answers /v1/embeddings only",
                           param="model")

    def admit(self, num_choices: int) -> None:
        self.engine.check_serving()
        if self.engine.num_in_flight + num_choices > self.max_in_flight:
            raise APIError(429, f"the server is at capacity ({self.engine.num_in_flight} requests in flight); "
                                "retry shortly", headers={"Retry-After": "1"})

    def validate(self, prompts: list[Prompt], params: SamplingParams) -> None:
        for prompt in prompts:
            try:
                self.engine.info.limits.validate(prompt.token_ids, params)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=e.param) from None

    async def check_grammar(self, body: OpenAIRequest, params: SamplingParams) -> None:
        """Parse the request's grammar here, off the event loop, so a bad one is a 400 before any stream starts
        (the engine compiles its token masks)."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(check_grammar, params.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e), param=_grammar_param(body)) from None

    def _prompt_text(self, prompt: Prompt) -> str:
        """What ``echo`` repeats: the prompt as sent, or its token ids decoded."""
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _choices(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> list[Choice]:
        return [Choice(s.request_id, prompts[s.index // params.n].token_ids, s.params, s.index)
                for s in fan_out(request_id, len(prompts), params)]

    def _sampling_params(self, body: OpenAIRequest, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs, self.sampling_defaults)
        except InvalidRequestError as e:
            param = _grammar_param(body) if e.param == "structured_outputs" else e.param
            raise APIError(400, str(e), param=param) from None

    # ---- /v1/completions ------------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        self.check_generative()
        prompts = await self.prompts.completion_prompts(body)
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = self._sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs)
        if body.num_samples > body.n:  # best_of: every sample's logprob ranks it, asked for or not
            params = dataclasses.replace(params, n=body.num_samples, logprobs=params.logprobs or 0)
        return await self._serve(body, raw, "cmpl", prompts, params, self.completion_format, body.logprobs, arrival,
                                 echo=body.echo, keep=body.n)

    # ---- /v1/chat/completions -------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        self.check_generative()
        prompt, params, reading = await self.prepare_chat(body)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await self._serve(body, raw, "chatcmpl", [prompt], params, self.chat_format, num_logprobs, arrival,
                                 reading=reading)

    async def prepare_chat(self, body: ChatCompletionRequest) -> tuple[Prompt, SamplingParams, ChatReading]:
        """A chat request's prompt, sampling and way of reading its text (also the Responses API's, which is
        turned into a chat request first)."""
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        try:
            plan = plan_tools(tools, choice, body.parallel_tool_calls, self.tool_call_parser)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        prompt = await self.prompts.chat_prompt(body.messages, body.add_generation_prompt,
                                                body.continue_final_message, body.template_kwargs(), tools)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = self.sampling_defaults.get("max_tokens")
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, num_logprobs, None)
        grammar = plan.structured_outputs()
        if grammar is not None:
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice {plan.kind!r} holds the output to the tools' schemas: it cannot be "
                                    "combined with response_format or structured_outputs", param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=grammar)
        params = self._with_thinking(body, params)
        reasoning = self.reasoning if body.separate_reasoning else None
        if plan.kind == "auto" or (reasoning is not None and reasoning.special_tokens):
            params = dataclasses.replace(params, skip_special_tokens=False)  # a parser's tags may be special tokens
        reading = ChatReading(plan if plan.kind != "none" else None, reasoning, prompt.text or "",
                              body.include_reasoning)
        return prompt, params, reading

    def _with_thinking(self, body: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
        """The thinking markers and bounds for the engine, where a reasoning parser is on."""
        budget = body.thinking_token_budget if body.thinking_token_budget is not None else self.thinking.max_tokens
        deadline = body.thinking_deadline_ms if body.thinking_deadline_ms is not None else self.thinking.deadline_ms
        if self.reasoning is None:
            for field in ("thinking_token_budget", "thinking_deadline_ms"):
                if getattr(body, field) is not None:
                    raise APIError(400, f"{field} needs a reasoning parser: start the server with --reasoning-parser",
                                   param=field)
            return params
        try:
            thinking = dataclasses.replace(self._thinking_markers, max_tokens=budget, deadline_ms=deadline)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return dataclasses.replace(params, thinking=thinking)

    # ---- shared -------------------------------------------------------------------------------------------------
    async def _serve(self, body: OpenAIRequest, raw: Request, prefix: str, prompts: list[Prompt],
                     params: SamplingParams, fmt: ResponseFormat, num_logprobs: int | None, arrival: float,
                     echo: bool = False, reading: ChatReading | None = None, keep: int | None = None) -> Response:
        """``reading``: how a chat's text becomes its message (thinking, content, tool calls). ``keep``: of the
        ``params.n`` samples of each prompt, answer with this many, those of the highest mean token logprob (best_of).
        ``arrival``: when the request came in (``time.monotonic()``), the start of its timeline. The response
        names its id in the body and in an ``X-Request-Id`` header (the key of ``/debug/requests/{id}``)."""
        self.validate(prompts, params)
        await self.check_grammar(body, params)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        choices = self._choices(request_id, prompts, params)
        self.admit(len(choices))
        created = int(time.time())
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        header = {"id": request_id, "created": created, "model": self.served_model_name}
        if body.stream:
            stream = self._stream(header, choices, prompts, fmt, num_logprobs, echo, body.include_usage,
                                  num_prompt_tokens, reading, arrival)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": request_id})
        states = sorted(await self.collect(choices, raw, arrival), key=lambda s: s.index)
        answered, n = states, params.n
        if keep is not None and keep < params.n:
            answered, n = _best_samples(states, params.n, keep), keep
        out_choices = []
        for state in answered:
            prompt = prompts[state.index // n]
            text, logprobs = state.text, None
            token_ids = list(state.token_ids)
            entries: list = list(state.logprobs or [])
            if echo:
                text = self._prompt_text(prompt) + text
                token_ids = prompt.token_ids + token_ids
                entries = list(state.prompt_logprobs or [None] * len(prompt.token_ids)) + entries
            if num_logprobs is not None:
                logprobs = fmt.logprobs(token_ids, entries, num_logprobs, 0)
            if reading is None or reading.plain:
                out_choices.append(fmt.choice(state.index, text, logprobs, state.finish_reason, state.stop_reason))
                continue
            content, reasoning, calls = reading.whole(text)
            finish = reading.finish_reason(state.finish_reason, bool(calls))
            out_choices.append(fmt.choice(state.index, content, logprobs, finish, state.stop_reason, calls,
                                          reasoning, reading.reasoning is not None))
        return JSONResponse({**header, "object": fmt.object, "choices": out_choices,
                             "usage": usage(num_prompt_tokens, states, params.n)}, headers={"X-Request-Id": request_id})

    async def collect(self, choices: list[Choice], raw: Request, arrival: float) -> list[RequestState]:
        finished: dict[int, RequestState] = {}

        async def consume() -> None:
            async with aclosing(self.engine.generate(choices, arrival)) as updates:
                async for update in updates:
                    if update.finished:
                        finished[update.state.index] = update.state

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
            raise APIError(400, str(e), param=e.param) from None
        except EngineDeadError as e:
            raise e.api_error() from None
        finally:
            if not task.done():
                task.cancel()
        return list(finished.values())

    async def _stream(self, header: dict, choices: list[Choice], prompts: list[Prompt], fmt: ResponseFormat,
                      num_logprobs: int | None, echo: bool, include_usage: bool,
                      num_prompt_tokens: int, reading: ChatReading | None, arrival: float) -> AsyncIterator[str]:
        chunk_header = {**header, "object": fmt.chunk_object}
        readers = {c.index: reading.reader() for c in choices} if reading is not None and not reading.plain else {}
        called: set[int] = set()
        sent_text = dict.fromkeys((c.index for c in choices), 0)
        sent_tokens = dict.fromkeys(sent_text, 0)
        text_offset = dict.fromkeys(sent_text, 0)
        states: dict[int, RequestState] = {}
        n = len(choices) // len(prompts)
        extra = {"usage": None} if include_usage else {}

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        # A token's chunk is the same JSON as event({**chunk_header, "choices": [choice], **extra}), its constant
        # parts serialized once: json.dumps was a tenth of the API process's time at 256 streams.
        chunk_head = json.dumps(chunk_header, ensure_ascii=False)[:-1] + ', "choices": ['
        chunk_tail = "], " + json.dumps(extra, ensure_ascii=False)[1:] if extra else "]}"

        def token_chunk(choice: dict) -> str:
            return f"data: {chunk_head}{json.dumps(choice, ensure_ascii=False)}{chunk_tail}\n\n"

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
            async with aclosing(self.engine.generate(choices, arrival)) as updates:
                async for update in updates:
                    state, finished = update.state, update.finished
                    i = state.index
                    states[i] = state
                    text = state.text[sent_text[i] : update.text_end]
                    new_ids = state.token_ids[sent_tokens[i] : update.num_tokens]
                    # NOTE: a token whose text is held back (half a UTF-8 character, a possible stop string) still
                    # gets its chunk, with empty text, as vLLM sends it: one chunk per token keeps a client's
                    # inter-token timing honest instead of merging two tokens' gaps into one.
                    if not text and not new_ids and not finished and i not in first_chunk:
                        continue
                    logprobs = None
                    if num_logprobs is not None and new_ids:
                        entries = state.logprobs[sent_tokens[i] : update.num_tokens]
                        logprobs = fmt.logprobs(new_ids, entries, num_logprobs, text_offset[i])
                        text_offset[i] += sum(len(fmt.token_text(t)) for t in new_ids)
                    sent_text[i], sent_tokens[i] = update.text_end, update.num_tokens
                    finish = state.finish_reason if finished else None
                    stop_reason = state.stop_reason if finish else None
                    chat_only: dict = {"first": True} if i in first_chunk else {}  # all empty for a completion
                    if readers:
                        delta = readers[i].feed(text, finished)
                        text = delta.content
                        if delta.tool_calls:
                            called.add(i)
                            chat_only["tool_calls"] = delta.tool_calls
                        if delta.reasoning:
                            chat_only["reasoning"] = delta.reasoning
                        finish = reading.finish_reason(finish, i in called)
                    first_chunk.discard(i)
                    choice = fmt.chunk_choice(i, text, logprobs, finish, stop_reason, **chat_only)
                    yield token_chunk(choice)
            if include_usage:
                total = usage(num_prompt_tokens, list(states.values()), n)
                yield event({**chunk_header, "choices": [], "usage": total})
        except RequestRejectedError as e:
            yield event(APIError(400, str(e), param=e.param).body())
        except EngineDeadError as e:
            yield event(e.api_error().body())
        except Exception as e:  # a bug: the stream still ends as a stream should, and the server goes on
            logger.exception("streaming a response failed")
            yield event(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        yield "data: [DONE]\n\n"


def _grammar_param(body: OpenAIRequest) -> str:
    """The request field a grammar came from: vLLM's structured_outputs, OpenAI's response_format, or the tools."""
    if body.structured_outputs is not None:
        return "structured_outputs"
    return "response_format" if body.response_format is not None else "tools"


def _best_samples(states: list[RequestState], num_samples: int, keep: int) -> list[RequestState]:
    """Of each prompt's ``num_samples`` samples (``states`` in index order), the ``keep`` with the highest mean
    token logprob (OpenAI's best_of), numbered as the answer's choices."""
    best = []
    for first in range(0, len(states), num_samples):
        group = sorted(states[first : first + num_samples],
                       key=lambda s: -(s.cumulative_logprob or 0.0) / max(1, len(s.token_ids)))
        prompt_index = first // num_samples
        best += [dataclasses.replace(s, index=prompt_index * keep + j) for j, s in enumerate(group[:keep])]
    return best
