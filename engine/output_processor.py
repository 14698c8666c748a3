"""Turns the engine core's per-step token deltas into text, applies stop strings, and gathers finished results.

Lives outside the core (the server runs it in the HTTP process) because detokenization is CPU work that must not
sit on the forward-pass loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, EngineCoreOutput, PositionLogprobs
from engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    """One sequence as the user sees it: text so far, tokens, logprobs and how it ended."""

    request_id: str
    index: int  # which of the n samples of its prompt
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # an embedding model's vector

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def to_completion(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestState:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        state = RequestState(request_id, index, prompt_token_ids, params, detok)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.states[request_id] = state
        return state

    def process(self, output: EngineCoreOutput) -> tuple[RequestState, bool]:
        """Apply one core output. Returns the state and whether a stop string finished it (the caller must then
        abort the request in the core, which does not know about text)."""
        state = self.states[output.request_id]
        if state.finished:
            return state, False
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = output.prompt_logprobs
        state.num_cached_tokens = output.num_cached_tokens
        if output.pooled is not None:
            state.pooled = output.pooled
        stopped = False
        # The core stops only on a stop token (EOS, stop_token_ids, or a grammar's end), the last one here. Like a
        # stop string, its text is left out unless include_stop_str_in_output: it shows with skip_special_tokens
        # off, or where stop_token_ids name plain tokens.
        last_text = len(output.new_token_ids) - (
            output.finish_reason == "stop" and not state.params.include_stop_str_in_output)
        for i, token_id in enumerate(output.new_token_ids):  # several where speculative drafts were accepted
            state.token_ids.append(token_id)
            if output.new_logprobs is not None and state.logprobs is not None:
                state.logprobs.append(output.new_logprobs[i])
                state.cumulative_logprob += output.new_logprobs[i][token_id].logprob
            if i == last_text:
                break
            stopped = state.detokenizer.add([token_id])
            if stopped:  # the token that completed the stop string is the last one kept
                break
        if stopped:
            state.finish_reason, state.stop_reason = "stop", state.detokenizer.stop_reason
        elif output.finish_reason is not None:
            state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
        return state, stopped and output.finish_reason is None

    def pop(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)
