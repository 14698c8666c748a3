"""A reasoning model's thinking, as the engine follows it token by token: where it stands (maybe about to think,
thinking, answering), how many thinking tokens it spent, and when to close it by force.

Why in the engine: a bound on thinking is kept by choosing tokens, which only the sampler can do. When thinking
reaches its token budget, or its deadline comes within reach, the sampler is told to emit the end marker's tokens
one step each (every other logit set to -inf), and the first answer token after a forced close may not end the
request, so a bounded request always answers. A deadline becomes a token budget live: the marker's remaining tokens
are forced once ``now + (remaining + 2) x step time + DELIVERY_S`` reaches it (the marker, the answer's first token,
a step of margin and the trip to the client), the step time being the longest step period of the last ``RECENT_S``
(``StepTimes``: from one step's start to the next, the loop's own work included), so it follows the load (a 2-core
CPU's step takes several times as long at 16 streams as at one). A grammar (structured outputs, tool calls) holds
the answer only: the thinking is free text.

Phases: a prompt that opens a thinking block it does not close (DeepSeek-R1's and Qwen3-Thinking's templates end in
``<think>``) starts THINKING; one that closes its last block (Qwen3 with ``enable_thinking`` off) starts ANSWER;
otherwise MAYBE: while the output spells the start marker's beginning the model may still open a block (Qwen3
writes ``<think>`` itself); the first token that does not ends MAYBE as ANSWER. Only the first block is followed.
"""

from __future__ import annotations

import collections
import enum
import time

from engine.sampling_params import ThinkingParams

RECENT_S = 2.0  # the step time a deadline plans with is the longest step period of this many recent seconds
# Time a token takes from the engine to the client (the pipe, the API process, HTTP): measured on the default model
# at 1 and 16 clients, tens of ms (loadtest/thinking_deadline.py)
DELIVERY_S = 0.05


class Phase(enum.Enum):
    MAYBE = "maybe"
    THINKING = "thinking"
    ANSWER = "answer"


def _ends_with(ids: list[int], marker: tuple[int, ...]) -> bool:
    return len(ids) >= len(marker) and tuple(ids[len(ids) - len(marker) :]) == marker


def _last_index(ids: list[int], marker: tuple[int, ...]) -> int:
    """Where ``marker`` last begins in ``ids``, or -1."""
    n = len(marker)
    first = marker[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and tuple(ids[i : i + n]) == marker:
            return i
    return -1


class ThinkingState:
    """One request's thinking. ``accept`` sees every output token in order; ``forced_token`` says what the next
    one must be, if anything."""

    def __init__(self, params: ThinkingParams, prompt_token_ids: list[int], arrival_time: float) -> None:
        self.params = params
        opened = _last_index(prompt_token_ids, params.start_ids)
        closed = _last_index(prompt_token_ids, params.end_ids)
        self.phase = Phase.THINKING if opened > closed else Phase.ANSWER if closed >= 0 else Phase.MAYBE
        self.deadline = arrival_time + params.deadline_ms / 1000 if params.deadline_ms is not None else None
        self.num_thinking_tokens = 0
        self.forced_end = False  # the end marker was forced: the answer's first token may not end the request
        self.num_answer_tokens = 0
        self._tail: list[int] = []  # the latest output tokens, enough to match either marker
        self._forcing = False

    @property
    def needs_answer(self) -> bool:
        """Whether end-of-sequence tokens are banned now: thinking was closed by force and nothing answered yet."""
        return self.forced_end and self.phase is Phase.ANSWER and self.num_answer_tokens == 0

    @property
    def may_force(self) -> bool:
        """Whether a later token may be forced (the request's tokens are then no plain argmaxes to draft)."""
        return self.params.bounded and self.phase is not Phase.ANSWER

    @property
    def grammar_active(self) -> bool:
        return self.phase is Phase.ANSWER

    def start_continuation(self) -> int | None:
        """In MAYBE, the start marker's next token, which a grammar must let through beside its own."""
        if self.phase is not Phase.MAYBE or len(self._tail) >= len(self.params.start_ids):
            return None
        return self.params.start_ids[len(self._tail)]

    def accept(self, token_id: int) -> bool:
        """Take the next output token; whether it belongs to the answer (a grammar sees exactly those)."""
        p = self.params
        self._tail.append(token_id)
        del self._tail[: -max(len(p.start_ids), len(p.end_ids))]
        if self.phase is Phase.ANSWER:
            self.num_answer_tokens += 1
            return True
        if self.phase is Phase.MAYBE:
            if tuple(self._tail) == p.start_ids[: len(self._tail)]:
                if len(self._tail) == len(p.start_ids):
                    self.phase, self._tail = Phase.THINKING, []
                return False
            self.phase = Phase.ANSWER
            self.num_answer_tokens += 1
            return True
        if _ends_with(self._tail, p.end_ids):  # the marker's earlier tokens were counted as thinking: take them back
            self.num_thinking_tokens -= len(p.end_ids) - 1
            self.phase, self._forcing, self._tail = Phase.ANSWER, False, []
            return False
        self.num_thinking_tokens += 1
        return False

    def forced_token(self, now: float, step_s: float) -> int | None:
        """The token the next step must emit to close the thinking in time, or None. ``now``: ``time.monotonic()``;
        ``step_s``: how long a step takes now."""
        if self.phase is not Phase.THINKING or not self.params.bounded:
            return None
        if not self._forcing:
            p = self.params
            remaining = len(p.end_ids) - self._matched_end()
            over_budget = p.max_tokens is not None and self.num_thinking_tokens - self._matched_end() >= p.max_tokens
            late = self.deadline is not None and now + (remaining + 2) * step_s + DELIVERY_S >= self.deadline
            if not (over_budget or late):
                return None
            self._forcing = self.forced_end = True
        return self.params.end_ids[self._matched_end()]

    def _matched_end(self) -> int:
        """How many of the end marker's first tokens the output ends with (a marker the model began itself)."""
        end = self.params.end_ids
        for k in range(min(len(end) - 1, len(self._tail)), 0, -1):
            if tuple(self._tail[len(self._tail) - k :]) == end[:k]:
                return k
        return 0


class StepTimes:
    """The engine's recent step periods: a deadline plans with the longest of the last ``RECENT_S`` seconds (a window
    in time, not in steps: it holds the prompts that joined the batch lately, whose steps run long, at any load)."""

    def __init__(self, initial_s: float = 0.05) -> None:
        self._recent: collections.deque[tuple[float, float]] = collections.deque([(0.0, initial_s)])
        self._busy_start: float | None = None  # a busy step's start, whose period the next step's start ends

    def stepped(self, start: float, busy: bool, more: bool) -> None:
        """A step began at ``start`` (``time.perf_counter()``), computed something (``busy``) and left requests to
        run (``more``): a period is measured between busy steps only, never across an idle wait."""
        if busy and self._busy_start is not None:
            self.observe(start - self._busy_start)
        self._busy_start = start if busy and more else None

    def observe(self, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._recent.append((now, seconds))
        while len(self._recent) > 1 and self._recent[0][0] < now - RECENT_S:
            self._recent.popleft()

    @property
    def step_s(self) -> float:
        return max(seconds for _, seconds in self._recent)
