"""The asyncio face of the engine: submits requests, turns step outputs into per-request text, keeps metrics, and
supervises the engine.

Each HTTP request gets one asyncio queue; every step's outputs are detokenized here (not in the engine process,
which keeps stepping meanwhile) and each output goes to its request's queue as an ``Update``. A request whose
consumer goes away (client disconnect, cancellation) is aborted in the engine, so its blocks are freed within one
step.

Supervision: the API process outlives its engine. When the engine dies (killed by the OOM killer, crashed on a bug)
or stalls with work in flight, every request in flight fails at once with a 503 that says so, and a new engine is
started: at once after a first death, then after a back-off that doubles while deaths come within
``STABLE_AFTER_S`` of a start. An engine that cannot be started again after ``MAX_START_ATTEMPTS`` tries is fatal:
``on_fatal`` is called with the reason, and the server exits non-zero (so a container's restart policy takes over).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.messages import (
    AbortRequests,
    AddRequest,
    DebugAnswer,
    DebugQuery,
    EngineFailed,
    RequestRejected,
    StepOutputs,
)
from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from server.engine_client import EngineClient
from server.metrics import Metrics
from server.protocol import APIError
from server.stats_history import StatsHistory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

STABLE_AFTER_S = 60.0  # an engine that ran this long before dying is restarted at once
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
MAX_START_ATTEMPTS = 5  # consecutive failed starts before giving up
WATCHDOG_INTERVAL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine is not serving: it died, and a new one is starting (or could not be started)."""

    def api_error(self) -> APIError:
        return APIError(503, f"the engine is not running: {self}", headers={"Retry-After": "5"})


class RequestRejectedError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Choice:
    """One engine request behind an HTTP request: ``index`` is its position among the response's choices."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int


@dataclass(frozen=True)
class Update:
    """One engine output of one choice, as it stood when it came in. The choice's ``state`` is shared and moves on
    with later outputs before a slow reader (a stream whose client reads slowly) takes this one: the figures here
    let a stream send one chunk per output, as vLLM does, instead of merging the outputs it fell behind on."""

    state: RequestState
    num_tokens: int  # of state.token_ids
    text_end: int  # how much of state.text may be shown (stop strings hold back a tail)
    finished: bool


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class AsyncEngine:
    def __init__(self, client: EngineClient, tokenizer: PreTrainedTokenizerBase, metrics: Metrics,
                 stall_timeout: float = 60.0, on_fatal: Callable[[str], None] | None = None) -> None:
        """``stall_timeout``: with requests in flight and no step finished for this long, the engine counts as
        dead and is restarted. ``on_fatal``: called once if no engine can be started again."""
        self.client = client
        self.info = client.info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        self.on_fatal = on_fatal
        self.processor = OutputProcessor(tokenizer)
        self.stats = self._idle_stats()
        self.dead_reason: str | None = None
        self.fatal_reason: str | None = None
        self.last_progress = time.monotonic()
        self._restarted_at: float | None = None  # when the engine now serving replaced a dead one
        self._rapid_deaths = 0  # deaths in a row, each within STABLE_AFTER_S of the restart before it
        self._queues: dict[str, asyncio.Queue] = {}
        self._timings: dict[str, _Timing] = {}
        self._kill_reason: str | None = None  # why the watchdog killed the engine, told instead of the signal
        self._restarting: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._closed = False
        self._queries: dict[int, asyncio.Future] = {}  # debug queries awaiting the engine's answer
        self._next_query = 0
        self.num_generated_tokens = 0  # over the server's life, engine restarts included
        self.history: StatsHistory | None = None  # the dashboard's, where the debug routes are on
        client.handler = self._on_message
        metrics.engine_up.set(1)
        metrics.describe_engine(self.info)

    def _idle_stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, self.info.limits.num_blocks, self.info.limits.num_blocks, 0)

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

    def check_serving(self) -> None:
        """Raise the 503 a new request gets while the engine is down."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason).api_error()

    def start_watchdog(self) -> None:
        """Restart an engine that stalls with requests in flight (call once, on the event loop)."""
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            stalled = time.monotonic() - self.last_progress
            if self.dead_reason is None and self._queues and stalled > self.stall_timeout:
                reason = f"engine made no progress for {stalled:.0f} s with {len(self._queues)} requests in flight"
                logger.error("%s: killing it", reason)
                self._kill_reason = f"{reason}, and was killed"
                if not self.client.kill():  # an engine that cannot be killed (a thread) is left behind
                    self._kill_reason = None
                    self._engine_died(reason)

    # ---- supervision ----------------------------------------------------------------------------------------------
    def _engine_died(self, reason: str) -> None:
        if self.dead_reason is not None or self._closed:
            return
        reason, self._kill_reason = self._kill_reason or reason, None
        restarted = self._restarted_at
        rapid = restarted is not None and time.monotonic() - restarted < STABLE_AFTER_S
        self._rapid_deaths = self._rapid_deaths + 1 if rapid else 0
        self.dead_reason = f"{reason}; a new engine is starting, retry shortly"
        self.stats = self._idle_stats()
        self.metrics.engine_died(self.stats)
        error = EngineDeadError(f"{reason}; the request was lost, retry it")
        for queue in set(self._queues.values()):
            queue.put_nowait(error)
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._restarting = asyncio.get_running_loop().create_task(self._restart(reason))

    async def _restart(self, reason: str) -> None:
        delay = 0.0 if self._rapid_deaths == 0 else min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._rapid_deaths - 1))
        for attempt in range(1, MAX_START_ATTEMPTS + 1):
            logger.warning("%s: starting a new engine in %.0f s (attempt %d of %d)", reason, delay, attempt,
                           MAX_START_ATTEMPTS)
            await asyncio.sleep(delay)
            if self._closed:
                return
            try:
                info = await self.client.start()
            except RuntimeError as e:
                reason = str(e).splitlines()[0]
                delay = min(MAX_BACKOFF_S, max(FIRST_BACKOFF_S, 2 * delay))
                continue
            self.info = info
            self.stats = self._idle_stats()
            self.metrics.engine_restarted(self.stats)
            self.metrics.describe_engine(info)
            self._restarted_at = self.last_progress = time.monotonic()
            self.dead_reason = None
            logger.warning("a new engine is serving (%d restarts so far)", self.metrics.num_restarts)
            return
        self.fatal_reason = f"the engine could not be started again after {MAX_START_ATTEMPTS} attempts: {reason}"
        self.dead_reason = self.fatal_reason
        logger.critical(self.fatal_reason)
        if self.on_fatal is not None:
            self.on_fatal(self.fatal_reason)

    async def close(self) -> None:
        self._closed = True
        for task in (self._restarting, self._watchdog):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # ---- requests -------------------------------------------------------------------------------------------------
    async def generate(self, choices: list[Choice], arrival_time: float | None = None) -> AsyncIterator[Update]:
        """Yield an ``Update`` for each engine output of a choice, in order, until every choice has finished.
        Leaving early (an error, a disconnect, a cancelled task) aborts whatever is still running. ``arrival_time``:
        when the HTTP request came in (``time.monotonic()``), where it did, for the engine's timelines."""
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
            self.client.send(AddRequest(choice.request_id, choice.prompt_token_ids, choice.params,
                                        arrival_time if arrival_time is not None else now))
        unfinished = {c.request_id for c in choices}
        try:
            while unfinished:
                item = await events.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    unfinished.discard(item.state.request_id)
                yield item
        finally:
            if unfinished and self.dead_reason is None:
                self.client.send(AbortRequests(sorted(unfinished)))
            for choice in choices:
                self._queues.pop(choice.request_id, None)
                self._timings.pop(choice.request_id, None)
                self.processor.pop(choice.request_id)

    async def debug(self, what: str, request_id: str | None = None, timeout: float = 10.0) -> object:
        """Ask the engine about its state between two steps (``DebugQuery``): its answer, JSON-ready."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._next_query += 1
        query_id = self._next_query
        future = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            self.client.send(DebugQuery(query_id, what, request_id))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._queries.pop(query_id, None)

    # ---- engine messages (on the event loop's thread) -------------------------------------------------------------
    def _on_message(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            self._on_step(message)
        elif isinstance(message, DebugAnswer):
            future = self._queries.get(message.query_id)
            if future is not None and not future.done():
                future.set_result(message.payload)
        elif isinstance(message, RequestRejected):
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(RequestRejectedError(message.message, message.param))
        elif isinstance(message, EngineFailed):
            self._engine_died(message.message.splitlines()[0])
        else:
            logger.warning("unexpected message from the engine: %r", message)

    def _on_step(self, message: StepOutputs) -> None:
        now = time.monotonic()
        self.last_progress = now
        self.stats = message.stats
        self.metrics.update_engine(message.stats)
        if self.history is not None:
            self.history.observe(now, message.stats, self.num_generated_tokens)
        stopped, generated = [], 0
        for output in message.outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue  # aborted on our side; the engine learns of it at its next step
            if output.error is not None:
                queue.put_nowait(RequestRejectedError(output.error))
                continue
            if self.processor.states[output.request_id].finished:
                continue  # a step's output after a stop string ended it here, before the engine heard of it
            state, stopped_by_string = self.processor.process(output)
            if stopped_by_string:
                stopped.append(output.request_id)
            generated += len(output.new_token_ids)
            self._observe(output.request_id, output.queue_time, state.finished, now)
            queue.put_nowait(Update(state, len(state.token_ids), state.detokenizer.stable_text_end(state.finished),
                                    state.finished))
        if generated:  # one counter update a step, not one a request (each takes a lock)
            self.metrics.generation_tokens.inc(generated)
            self.num_generated_tokens += generated
        if stopped:
            self.client.send(AbortRequests(stopped))

    def _observe(self, request_id: str, queue_time: float | None, finished: bool, now: float) -> None:
        timing = self._timings[request_id]
        if queue_time is not None:
            self.metrics.queue_time.observe(queue_time)
        if timing.last_token is None:
            self.metrics.ttft.observe(now - timing.arrival)
        else:
            self.metrics.itl.observe(now - timing.last_token)
        timing.last_token = now
        if finished:
            self.metrics.e2e.observe(now - timing.arrival)
