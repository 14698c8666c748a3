"""The engine process's entry point, over a pipe to the API process.

Light to import on purpose: the API process names ``run_engine_process`` as the target of the process it spawns,
and only the child loads the model, the kernels and the engine loop.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

from engine.config import EngineConfig


def run_engine_process(config: EngineConfig, conn: Connection, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.engine_loop import run_engine_loop  # the heavy part, in this process only

    def receive(block: bool) -> list[object]:
        messages = [conn.recv()] if block else []
        while conn.poll():
            messages.append(conn.recv())
        return messages

    try:
        run_engine_loop(config, receive, conn.send, freeze_heap=True)
    except (EOFError, BrokenPipeError):
        pass  # the server went away: nothing left to serve
