"""An engine is freed the moment its last reference goes, without waiting for the garbage collector.

On a GPU its KV pool is most of the device's memory. A reference cycle through the engine keeps that pool until
Python's cycle collector happens to run (which counts objects, not device bytes), or forever once the serving loop
has frozen the start-up heap (``gc.freeze``), so that the next engine in the process finds no memory.

While it lives, its loop reports each step with the step's own time in it.
"""

from __future__ import annotations

import gc
import time
import weakref

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.engine_loop import run_engine_loop
from engine.messages import AddRequest, EngineReady, Shutdown, StepOutputs
from engine.sampling_params import SamplingParams, StructuredOutputsParams


def test_an_engine_is_freed_by_its_last_reference(tiny_model):
    gc.collect()
    gc.disable()
    try:
        engine = EngineCore(EngineConfig(model=str(tiny_model("llama-gqa-tied")), block_size=4,
                                         kv_cache_memory=4 << 20, max_num_batched_tokens=16))
        # a grammar builds the tokenizer and starts the compile thread: neither may hold the engine
        params = SamplingParams(max_tokens=4, temperature=0.0,
                                structured_outputs=StructuredOutputsParams(choice=("yes", "no")))
        engine.add_request("r", [1, 2, 3], params)
        for _ in range(50):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert not engine.has_unfinished_requests()
        pool = weakref.ref(engine.kv_cache)
        freed = weakref.ref(engine)
        del engine
        assert freed() is None, gc.get_referrers(freed())
        assert pool() is None
    finally:
        gc.enable()


def test_the_stats_a_step_sends_hold_that_steps_time(tiny_model):
    """The loop's busy time in each step's stats covers every phase of that step: the bench's step profile is the
    difference of two such readings, and a lagging one credited a window with the step before it."""
    sent: list[object] = []
    inbox: list[list[object]] = [[AddRequest(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=6, temperature=0.0))
                                  for i in range(3)]]

    def receive(block: bool) -> list[object]:
        if inbox:
            return inbox.pop()
        return [Shutdown()] if block else []  # blocking: the work is done

    def send(message: object) -> None:
        if isinstance(message, StepOutputs):
            time.sleep(0.002)  # a send that takes time: counted in the next step's stats, never before its step
        sent.append(message)

    config = EngineConfig(model=str(tiny_model("llama-gqa-tied")), block_size=4, kv_cache_memory=4 << 20,
                          max_num_batched_tokens=16)
    run_engine_loop(config, receive, send)
    assert isinstance(sent[0], EngineReady)
    steps = [m.stats.steps for m in sent[1:] if isinstance(m, StepOutputs)]
    assert len(steps) >= 6 and steps[-1].num_steps == len(steps)
    for counters in steps:  # this step's phases and the sends before it: the lag is one send
        assert counters.loop_s - counters.step_s >= 0.002 * (counters.num_steps - 1) - 1e-9
