"""What the engine hands back: per-step deltas from the core, and finished results from the offline API."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's logprobs: the scored token first, then the top-N alternatives (a token may appear in both).
PositionLogprobs = dict[int, Logprob]


@dataclass
class StepCounters:
    """The engine's steps, cumulative: how many, what they computed and where their time went (seconds). The bench's
    step profile and /metrics are differences of two readings."""

    num_steps: int = 0
    num_tokens: int = 0  # tokens computed (scheduled)
    num_decode_tokens: int = 0  # of those, of requests decoding one token
    num_scheduled_requests: int = 0  # requests in the steps' batches, summed over the steps
    num_logit_rows: int = 0  # rows through the full LM head
    gemm_flops: float = 0.0  # of the projections and the LM head
    schedule_s: float = 0.0
    prepare_s: float = 0.0  # the runner's inputs: the flattened batch and its metadata
    forward_s: float = 0.0
    sample_s: float = 0.0  # logits, sampling, drafts' verification, prompt logprobs
    update_s: float = 0.0  # the scheduler's update and the step's outputs
    loop_s: float = 0.0  # the engine loop's busy time: the steps, and taking commands and sending outputs

    @property
    def step_s(self) -> float:
        """The steps' time: their phases summed (``loop_s`` adds the loop's own work beside them)."""
        return sum(getattr(self, f"{phase}_s") for phase in STEP_PHASES)


STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update")  # a step's parts, each a StepCounters <phase>_s


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_cached_blocks: int = 0  # blocks holding a cached prefix, in use or free but evictable
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int = 0  # of those, tokens found cached
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified, cumulative
    spec_accepted_tokens: int = 0  # of those, drafts kept
    steps: StepCounters = field(default_factory=StepCounters)


@dataclass
class ModelRunnerOutput:
    """What one step computed, per request id (the scheduler turns it into request state and core outputs)."""

    # The new tokens of every request that reached the end of its known tokens: one, or several where a draft
    # was verified (engine/spec_decode.py).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # Logprobs of prompt tokens scored this step (chunk by chunk), in prompt order.
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Where the runner's time went (seconds), and the rows it took through the full LM head.
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    num_logit_rows: int = 0
    # An embedding model's vectors, of the requests whose prompts this step finished (engine/pooler.py)
    pooled: dict[str, list[float]] = field(default_factory=dict)



@dataclass
class EngineCoreOutput:
    """What one step produced for one request: new tokens since the previous output, and how it ended, if it did."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    # Sent once, with the first new token: entry 0 is None (the first prompt token has no context to score it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival in the engine to the first step; with the first token
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    error: str | None = None  # why it could not be served (finish_reason "abort", no tokens): for the user
    pooled: list[float] | None = None  # an embedding model's vector, with the request's end

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple[type, tuple]:
        """Pickled as its fields in order, not as a state dict: the engine sends one a request each step, and 256 of
        them unpickled in 109 us against 402 (the API process's reads of the pipe were a tenth of its time at 256
        streams; served, the gain was within the noise of loadtest/lab/front_end.py)."""
        return EngineCoreOutput, _core_output_fields(self)


_core_output_fields = operator.attrgetter(*(f.name for f in fields(EngineCoreOutput)))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, summed over the n samples
