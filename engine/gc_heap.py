"""Keep the start-up heap out of Python's cyclic garbage collector.

A server process holds hundreds of thousands of long-lived objects once torch, transformers and the model are
loaded, and a collection of the oldest generation walks all of them while every stream waits. On an H100 serving
256 clients, the ITL p99 was 324-832 ms without this and 79-220 ms with it (docs/history/benchmarks-2026-11.md).
What start-up made stays alive for the whole process, so both server processes move it to the permanent generation
once they are ready, as vLLM does; later collections walk only what serving itself allocates.
"""

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()
    logger.info("start-up heap: %d objects kept out of garbage collection", gc.get_freeze_count())
