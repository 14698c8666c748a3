"""Server processes for the benchmarks that start their own: start (optionally pinned to cores), wait until
healthy, stop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import aiohttp


def start(args: list[str], log: Path, cores: list[int] | None = None) -> subprocess.Popen:
    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    return subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=pin,
                            start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    async def poll() -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
                try:
                    async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{url} not healthy after {timeout:.0f} s:\n{log.read_text()[-2000:]}")

    asyncio.run(poll())


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
