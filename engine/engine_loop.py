"""The engine core's busy loop: take commands between steps, step while there is work, report every step.

Transport-agnostic: the multiprocess client runs it in a child process over a pipe, the in-process client on a
thread over a queue; both give it ``receive(block)`` and ``send(message)``.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.gc_heap import freeze_startup_heap
from engine.messages import (
    AbortRequests,
    AddRequest,
    DebugAnswer,
    DebugQuery,
    EngineFailed,
    EngineInfo,
    EngineReady,
    RequestRejected,
    Shutdown,
    StepOutputs,
)

logger = logging.getLogger(__name__)

RECENT_REQUESTS = 200  # the most request summaries a "recent" query answers with

Receive = Callable[[bool], list[object]]  # block -> the messages waiting (at least one when blocking)
Send = Callable[[object], None]


def engine_info(engine: EngineCore) -> EngineInfo:
    return EngineInfo(
        model_name=engine.model_name,
        model_path=str(engine.model_path),
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        limits=engine.limits,
        kv_cache=engine.kv_cache.describe(),
        max_num_seqs=engine.config.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        backend=engine.backend.describe(),
        gemm_plan=plan.as_dict() if (plan := getattr(engine.backend, "plan", None)) is not None else None,
        kernel_plan=tuple(engine.kernel_plan.as_dict()),
        kernel_plan_labels=engine.kernel_plan.labels(),
        request_timelines=engine.config.request_timelines,
        pooling=engine.pooling,
    )


def run_engine_loop(config: EngineConfig, receive: Receive, send: Send, own_process: bool = False) -> None:
    """``own_process``: in a process of its own (a server's engine), keep the start-up heap out of later garbage
    collections, and let the backend measure the machine once started (``EngineCore``'s ``own_process``)."""
    try:
        engine = EngineCore(config, own_process)
    except Exception as e:
        send(EngineFailed(f"engine failed to start: {e}\n{traceback.format_exc()}"))
        return
    if own_process:
        freeze_startup_heap()
    send(EngineReady(engine_info(engine)))
    try:
        while True:
            for message in receive(not engine.has_unfinished_requests()):
                if isinstance(message, Shutdown):
                    return
                _handle(engine, message, send)
            if engine.has_unfinished_requests():
                # The stats a step sends hold that step's whole time; its send is counted in the next step's. (Timed
                # after the send, a step's stats lagged it by one step: a reading taken after a short step then
                # counted the long one before a bench's window, and the engine looked busier than the wall clock.)
                start = time.perf_counter()
                outputs = engine.step()
                engine.counters.loop_s += time.perf_counter() - start
                start = time.perf_counter()
                send(StepOutputs(outputs, engine.stats()))
                engine.counters.loop_s += time.perf_counter() - start
    except Exception as e:  # a bug, not bad input: report it so the server fails requests fast, then stop
        logger.exception("engine loop crashed")
        send(EngineFailed(f"engine crashed: {e}"))


def _handle(engine: EngineCore, message: object, send: Send) -> None:
    if isinstance(message, AddRequest):
        try:
            engine.add_request(message.request_id, message.prompt_token_ids, message.params, message.arrival_time)
        except ValueError as e:
            send(RequestRejected(message.request_id, str(e), getattr(e, "param", None)))
    elif isinstance(message, AbortRequests):
        engine.abort_requests(message.request_ids)
        send(StepOutputs([], engine.stats()))
    elif isinstance(message, DebugQuery):
        send(DebugAnswer(message.query_id, debug_answer(engine, message)))
    else:
        raise TypeError(f"unexpected message {message!r}")


def debug_answer(engine: EngineCore, query: DebugQuery) -> object:
    if query.what == "kv":
        return engine.kv_view()
    if query.what == "memory":
        return engine.memory_ledger.refreshed().as_json()
    if query.what == "recent":
        return None if engine.timelines is None else engine.timelines.recent(RECENT_REQUESTS)
    if query.what == "requests":
        return None if engine.timelines is None else engine.timelines.get(query.request_id or "")
    raise ValueError(f"unknown debug query {query.what!r}")
