"""An engine is freed the moment its last reference goes, without waiting for the garbage collector.

On a GPU its KV pool is most of the device's memory. A reference cycle through the engine keeps that pool until
Python's cycle collector happens to run (which counts objects, not device bytes), or forever once the serving loop
has frozen the start-up heap (``gc.freeze``), so that the next engine in the process finds no memory.
"""

from __future__ import annotations

import gc
import weakref

from engine.config import EngineConfig
from engine.engine_core import EngineCore
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
