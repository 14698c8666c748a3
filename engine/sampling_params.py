"""What a user asks of one generation: how to sample and when to stop."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
# A seed is a 64-bit signed integer (vLLM's and torch's range); the n samples of a request use seed .. seed + n - 1,
# which torch's generators take up to 2**64 - 1.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match: exactly one of the fields (vLLM's ``structured_outputs`` names)."""

    json: str | None = None  # a JSON schema, as JSON text (a dict is dumped, its key order kept)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings, exactly
    grammar: str | None = None  # EBNF, in xgrammar's dialect (GBNF: root ::= ...)
    # JSON without whitespace between its tokens (JSON's own allows any; a small model may then emit it endlessly)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = self._given()
        if len(given) != 1:
            raise InvalidRequestError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                                      f"{', '.join(given) or 'none'}", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs choice must be a non-empty list of non-empty strings",
                                      "structured_outputs")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"structured_outputs {name} must be a non-empty string", "structured_outputs")

    def _given(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]


@dataclass(frozen=True)
class ThinkingParams:
    """Where a reasoning model's thinking opens and closes (token ids of its markers, from the server's reasoning
    parser), and the bounds on it: ``max_tokens`` thinking tokens (vLLM's ``thinking_token_budget``) and/or
    ``deadline_ms`` of wall-clock time from the request's arrival. Reaching either, the engine forces the end
    marker (engine/thinking.py). Without bounds the markers still matter: a grammar applies to the answer only."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    max_tokens: int | None = None
    deadline_ms: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_ids", tuple(int(t) for t in self.start_ids))
        object.__setattr__(self, "end_ids", tuple(int(t) for t in self.end_ids))
        if not self.start_ids or not self.end_ids:
            raise ValueError("thinking markers must be non-empty token id sequences")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequestError(f"thinking_token_budget must be >= 0, got {self.max_tokens}",
                                      "thinking_token_budget")
        if self.deadline_ms is not None and not self.deadline_ms > 0:
            raise InvalidRequestError(f"thinking_deadline_ms must be > 0, got {self.deadline_ms}",
                                      "thinking_deadline_ms")

    @property
    def bounded(self) -> bool:
        return self.max_tokens is not None or self.deadline_ms is not None


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules for one request, validated at construction.

    ``temperature == 0`` means greedy: the exact argmax of the processed logits. ``top_k <= 0`` and
    ``top_p == 1`` and ``min_p == 0`` disable those filters. ``logprobs`` is the number of top alternatives
    returned per sampled token (the sampled token's own is always included); ``prompt_logprobs`` the same for
    each prompt token. Stop strings are matched on the detokenized text, outside the engine core.
    ``structured_outputs`` keeps every output token inside a grammar (engine/structured_output.py).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text (vLLM's option)
    structured_outputs: StructuredOutputsParams | None = None
    thinking: ThinkingParams | None = None  # a reasoning model's thinking markers and bounds

    def __post_init__(self) -> None:
        # Accept lists and a single stop string from callers, store tuples (the dataclass is frozen and hashable).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in (self.logit_bias or {}).items()})
        self._validate()

    def _validate(self) -> None:
        """Raise InvalidRequestError naming the field at fault and what it allows."""

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{param} {message}", param)

        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= -1, "top_k", f"must be -1 or 0 (disabled) or positive, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(self.seed is None or MIN_SEED <= self.seed <= MAX_SEED, "seed",
              f"must be a 64-bit signed integer, in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              f"must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
              f"must be in (0, 2], got {self.repetition_penalty}")
        check(len(self.stop) <= MAX_STOP_SEQUENCES, "stop",
              f"may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(self.stop)}")
        check(all(s for s in self.stop), "stop", "sequences must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                  f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
              "cannot be combined with structured outputs: the grammar decides where the output may end")
        for token_id, bias in self.logit_bias.items():
            check(-100.0 <= bias <= 100.0, "logit_bias", f"for token {token_id} must be in [-100, 100], got {bias}")

    def for_sample(self, index: int) -> SamplingParams:
        """Sample ``index`` of ``n`` runs as a request of its own with n=1; a seed is offset by the index so the
        samples differ from each other yet repeat from run to run."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def plain_argmax(self) -> bool:
        """The token is the argmax of the raw logits: greedy, no bias, penalty or grammar changes them, and no logprobs
        are asked for. (A pending ``min_tokens`` may still ban tokens: that depends on the request's progress.)"""
        return (self.greedy and not self.logit_bias and not self.has_penalties and self.logprobs is None
                and self.structured_outputs is None and (self.thinking is None or not self.thinking.bounded))
