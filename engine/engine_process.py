"""The engine process's entry point, over a pipe to the API process.

Light to import on purpose: the API process names ``run_engine_process`` as the target of the process it spawns,
and only the child loads the model, the kernels and the engine loop.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

from engine.config import EngineConfig

# NOTE: how the engine process's OpenMP threads wait, unless the user set it. OpenMP reads these once, when the
# process loads it, so the API process puts them in the environment the engine process starts with. By default an
# idle OpenMP thread spins ~300k iterations between parallel regions; on a 2-core machine that spin takes the core
# the API process needs to stream tokens, and one client's stream ran 5-13% slower (docs/history/benchmarks-2026-12.md).
# Spinning ~10k iterations still bridges the gaps between one step's kernels and frees the core soon after.
ENGINE_PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def run_engine_process(config: EngineConfig, conn: Connection, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.engine_loop import run_engine_loop  # the heavy part, in this process only

    def receive(block: bool) -> list[object]:
        messages = [conn.recv()] if block else []
        while conn.poll():
            messages.append(conn.recv())
        return messages

    try:
        run_engine_loop(config, receive, conn.send, own_process=True)
    except (EOFError, BrokenPipeError):
        pass  # the server went away: nothing left to serve
