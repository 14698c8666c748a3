"""The engine core's state for one sequence being generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import Grammar
from engine.thinking import ThinkingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """One sequence: its tokens, how many of them have K/V in the cache, and its sampling state.

    Invariant: ``0 <= num_computed_tokens <= num_tokens``. The scheduler moves ``num_computed_tokens`` forward by
    what it schedules; preemption (by recompute) resets it to 0 and keeps every token, so the recomputed K/V
    are exactly the ones that were dropped and the output continues as if nothing happened.

        all_token_ids:  [ prompt ............ | output ...... ]
                          ^ computed (K/V in cache) ^ scheduled now ^ num_tokens
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved: never None, bounded by max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token id that ended it, if any
    generator: torch.Generator | None = None
    # Prompt logprobs are collected once; a recompute after preemption does not produce them again.
    num_prompt_logprobs_done: int = 0
    prompt_logprobs: list = field(default_factory=list)
    # Prefix caching: the chained hash of each full block of all_token_ids (extended as tokens are added), and how
    # many prompt tokens the first admission found already cached.
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Speculative decoding: tokens guessed to follow all_token_ids, verified by the next step (engine/spec_decode.py)
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: where the output stands in its grammar, fed every output token as it is appended
    grammar: Grammar | None = None
    # A reasoning model's thinking (when the request names its markers): a grammar holds only the answer
    thinking: ThinkingState | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        for token_id in self.output_token_ids:
            self.all_token_ids.append(token_id)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_logprobs_requested(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        answer = self.thinking.accept(token_id) if self.thinking is not None else True
        if self.grammar is not None and answer:
            self.grammar.accept(token_id)

    @property
    def grammar_active(self) -> bool:
        """Whether the grammar holds the next token (not while the model thinks)."""
        return self.grammar is not None and (self.thinking is None or self.thinking.grammar_active)

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Hash every full block not hashed yet; block i's hash covers its tokens and block i-1's hash, so equal
        hashes mean equal prefixes (the block manager still compares token ids on a hit)."""
        for i in range(len(self.block_hashes), self.num_tokens // block_size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash((parent, tuple(self.all_token_ids[i * block_size : (i + 1) * block_size]))))
        return self.block_hashes
