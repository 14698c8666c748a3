"""The asyncio face of the engine: submits requests, turns step outputs into per-request text, keeps metrics.

Each HTTP request gets one asyncio queue; every step's outputs are detokenized here (not in the engine process,
which keeps stepping meanwhile) and the affected requests are woken. A request whose consumer goes away
(client disconnect, cancellation) is aborted in the engine, so its blocks are freed within one step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.engine_core import EngineStats
from engine.output_processor import OutputProcessor, RequestState
from engine.sampling_params import SamplingParams
from server.engine_client import EngineClient
from server.messages import AbortRequests, AddRequest, EngineFailed, RequestRejected, StepOutputs
from server.metrics import Metrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestRejectedError(ValueError):
    pass


@dataclass(frozen=True)
class Choice:
    """One engine request behind an HTTP request: ``index`` is its position among the response's choices."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class AsyncEngine:
    def __init__(self, client: EngineClient, tokenizer: PreTrainedTokenizerBase, metrics: Metrics,
                 stall_timeout: float = 60.0) -> None:
        self.client = client
        self.info = client.info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        self.processor = OutputProcessor(tokenizer)
        self.stats = EngineStats(0, 0, 0.0, self.info.limits.num_blocks, self.info.limits.num_blocks, 0)
        self.dead_reason: str | None = None
        self.last_progress = time.monotonic()
        self._queues: dict[str, asyncio.Queue] = {}
        self._timings: dict[str, _Timing] = {}
        client.handler = self._on_message

    # ---- health ---------------------------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def health_problem(self) -> str | None:
        """Why the engine is unhealthy, or None: it must be alive and, while it has work, making progress."""
        if self.dead_reason is not None:
            return self.dead_reason
        if not self.client.is_alive():
            return "engine is not running"
        stalled = time.monotonic() - self.last_progress
        if self._queues and stalled > self.stall_timeout:
            return f"engine made no progress for {stalled:.0f} s with {len(self._queues)} requests in flight"
        return None

    # ---- requests -------------------------------------------------------------------------------------------------
    async def generate(self, choices: list[Choice]) -> AsyncIterator[RequestState]:
        """Yield a choice's state each time it changes, until every choice has finished. Leaving early (an error,
        a disconnect, a cancelled task) aborts whatever is still running."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        events: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        if not self._queues:
            self.last_progress = now  # an idle engine has nothing to have progressed on
        for choice in choices:
            self.processor.add_request(choice.request_id, choice.index, choice.prompt_token_ids, choice.params)
            self._queues[choice.request_id] = events
            self._timings[choice.request_id] = _Timing(now)
            self.metrics.prompt_tokens.inc(len(choice.prompt_token_ids))
            self.client.send(AddRequest(choice.request_id, choice.prompt_token_ids, choice.params))
        unfinished = {c.request_id for c in choices}
        try:
            while unfinished:
                item = await events.get()
                if isinstance(item, Exception):
                    raise item
                state = self.processor.states[item]
                if state.finished:
                    unfinished.discard(item)
                yield state
        finally:
            if unfinished and self.dead_reason is None:
                self.client.send(AbortRequests(sorted(unfinished)))
            for choice in choices:
                self._queues.pop(choice.request_id, None)
                self._timings.pop(choice.request_id, None)
                self.processor.pop(choice.request_id)

    # ---- engine messages (on the event loop's thread) -------------------------------------------------------------
    def _on_message(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            self._on_step(message)
        elif isinstance(message, RequestRejected):
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(RequestRejectedError(message.message))
        elif isinstance(message, EngineFailed):
            self.dead_reason = message.message.splitlines()[0]
            for queue in set(self._queues.values()):
                queue.put_nowait(EngineDeadError(self.dead_reason))
        else:
            logger.warning("unexpected message from the engine: %r", message)

    def _on_step(self, message: StepOutputs) -> None:
        now = time.monotonic()
        self.last_progress = now
        self.stats = message.stats
        self.metrics.update_engine(message.stats)
        stopped = []
        for output in message.outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue  # aborted on our side; the engine learns of it at its next step
            if output.error is not None:
                queue.put_nowait(RequestRejectedError(output.error))
                continue
            state, stopped_by_string = self.processor.process(output)
            if stopped_by_string:
                stopped.append(output.request_id)
            self._observe(output.request_id, len(output.new_token_ids), output.queue_time, state.finished, now)
            queue.put_nowait(output.request_id)
        if stopped:
            self.client.send(AbortRequests(stopped))

    def _observe(self, request_id: str, num_new: int, queue_time: float | None, finished: bool, now: float) -> None:
        timing = self._timings[request_id]
        self.metrics.generation_tokens.inc(num_new)
        if queue_time is not None:
            self.metrics.queue_time.observe(queue_time)
        if timing.last_token is None:
            self.metrics.ttft.observe(now - timing.arrival)
        else:
            self.metrics.itl.observe(now - timing.last_token)
        timing.last_token = now
        if finished:
            self.metrics.e2e.observe(now - timing.arrival)
