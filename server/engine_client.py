"""The one interface between the HTTP edge and the engine core, in two transports.

``MultiprocessEngineClient`` (serving): the engine core runs in its own process, so a forward pass never holds the
event loop or the GIL, and a crash is seen as the pipe closing. ``InProcessEngineClient`` (tests, embedding): the
same loop on a thread. Messages go out through ``send`` and come back to ``handler`` on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.engine_process import ENGINE_PROCESS_ENV, run_engine_process
from engine.messages import EngineFailed, EngineInfo, EngineReady, Shutdown

logger = logging.getLogger(__name__)

Handler = Callable[[object], None]


class EngineClient(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: EngineInfo | None = None
        self.handler: Handler = lambda message: None

    @abstractmethod
    async def start(self) -> EngineInfo:
        """Start the engine and wait until its model is loaded; raise RuntimeError if it fails to start. Called
        again after the engine died, it starts a new one."""

    @abstractmethod
    def send(self, message: object) -> None: ...

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    async def shutdown(self) -> None: ...

    def kill(self) -> bool:
        """Kill a stalled engine; its death is then reported as any other. False where it cannot be killed."""
        return False

    def _ready(self, message: object) -> EngineInfo:
        if isinstance(message, EngineFailed):
            raise RuntimeError(message.message)
        assert isinstance(message, EngineReady), message
        self.info = message.info
        return message.info


class MultiprocessEngineClient(EngineClient):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.process: mp.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self._outbox: queue.Queue[object | None] = queue.Queue()
        self._sender: threading.Thread | None = None
        self._closed = False

    async def start(self) -> EngineInfo:
        self._release()  # a previous engine's pipe and sender, if it died
        ctx = mp.get_context("spawn")
        for name, value in ENGINE_PROCESS_ENV.items():  # inherited by the child, read when its OpenMP loads
            os.environ.setdefault(name, value)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=run_engine_process, name="harpoon-engine", daemon=True,
                                   args=(self.config, child, logging.getLogger().getEffectiveLevel()))
        self.process.start()
        child.close()
        loop = asyncio.get_running_loop()
        try:
            info = self._ready(await loop.run_in_executor(None, self._first_message))
        except RuntimeError:
            self._release()
            raise
        loop.add_reader(self.conn.fileno(), functools.partial(self._on_readable, self.conn, self.process))
        # NOTE: a blocking send from the event loop could stall it while the engine is mid-step and the pipe is
        # full; a sender thread keeps the loop free.
        self._outbox = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, args=(self.conn, self._outbox),
                                        name="harpoon-engine-sender", daemon=True)
        self._sender.start()
        return info

    def _first_message(self) -> object:
        try:
            while not self.conn.poll(0.5):
                if not self.process.is_alive():
                    return EngineFailed(f"engine process {describe_exit(self.process.exitcode)} while starting")
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            return EngineFailed(f"engine process {describe_exit(self.process.exitcode)} while starting")

    def _on_readable(self, conn: Connection, process: mp.process.BaseProcess) -> None:
        """Messages of the engine behind ``conn``; its EOF is that engine's death, whichever engine runs now."""
        try:
            while conn.poll():
                self.handler(conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
            process.join(1)  # the pipe closes as the process exits: reap it, for its exit code
            if not self._closed:
                reason = f"engine process {describe_exit(process.exitcode)}"
                logger.error(reason)
                self.handler(EngineFailed(reason))

    def _release(self) -> None:
        """Forget a dead engine: stop its sender, close its pipe, reap its process."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender = None
        if self.conn is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.conn.fileno())
            except (ValueError, OSError):
                pass  # already closed
            self.conn.close()
            self.conn = None
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
            self.process = None

    @staticmethod
    def _send_loop(conn: Connection, outbox: queue.Queue[object | None]) -> None:
        while (message := outbox.get()) is not None:
            try:
                conn.send(message)
            except (BrokenPipeError, OSError):
                return

    def send(self, message: object) -> None:
        self._outbox.put(message)

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def kill(self) -> bool:
        if self.process is None or not self.process.is_alive():
            return False
        self.process.kill()
        return True

    async def shutdown(self) -> None:
        self._closed = True
        if self.process is None:
            return
        self.send(Shutdown())
        self._outbox.put(None)
        self._sender = None
        await asyncio.get_running_loop().run_in_executor(None, self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
        self._release()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


class InProcessEngineClient(EngineClient):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._inbox: queue.Queue[object] = queue.Queue()
        self._thread: threading.Thread | None = None

    async def start(self) -> EngineInfo:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[object] = loop.create_future()

        def send(message: object) -> None:
            if not first.done():
                loop.call_soon_threadsafe(first.set_result, message)
            else:
                loop.call_soon_threadsafe(self.handler, message)

        def receive(block: bool) -> list[object]:
            messages = [self._inbox.get()] if block else []
            while not self._inbox.empty():
                messages.append(self._inbox.get_nowait())
            return messages

        from engine.engine_loop import run_engine_loop  # the model and kernels load in this process, once asked

        self._thread = threading.Thread(target=run_engine_loop, args=(self.config, receive, send),
                                        name="harpoon-engine", daemon=True)
        self._thread.start()
        return self._ready(await first)

    def send(self, message: object) -> None:
        self._inbox.put(message)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self.send(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)


def describe_exit(exitcode: int | None) -> str:
    """How an engine process ended, for an operator: a signal by name (SIGKILL is what the OOM killer sends)."""
    if exitcode is None:
        return "stopped answering"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    name = signal.Signals(-exitcode).name
    hint = " (the kernel's OOM killer sends it when memory runs out)" if -exitcode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def make_engine_client(config: EngineConfig, in_process: bool = False) -> EngineClient:
    if in_process or os.environ.get("HARPOON_IN_PROCESS_ENGINE") == "1":
        return InProcessEngineClient(config)
    return MultiprocessEngineClient(config)
