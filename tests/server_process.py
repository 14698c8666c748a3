"""Starts a real ``harpoon serve`` process on a free loopback port for a test, and stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import QUICK_ENGINE

ROOT = Path(__file__).resolve().parent.parent


def parse_metrics(text: str) -> dict[str, float]:
    """The server's own series from a Prometheus page, by name (histogram buckets left out)."""
    values = {}
    for line in text.splitlines():
        if line.startswith("harpoon:") and "{" in line:
            name = line.split("{", 1)[0]
            if "_bucket" not in name:
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# conftest.QUICK_ENGINE as flags, for a test server and each engine it restarts, unless the test passes its own: a
# start took ~14 s without them, ~10 s with.
QUICK_START = tuple(x for name, value in QUICK_ENGINE.items() for x in (f"--{name.replace('_', '-')}", str(value)))


class ServerProcess:
    """``wait=False`` returns once the process is started (``wait_healthy`` then), so a test can start several."""

    def __init__(self, *args: str, timeout: float = 180.0, wait: bool = True) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = Path(f"/tmp/harpoon-test-server-{self.port}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(  # the test's own flags come last: the last of a repeated flag wins
            [sys.executable, "-m", "server", "--port", str(self.port), "--log-level", "warning", *QUICK_START, *args],
            cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
        )
        if wait:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server did not become healthy:\n{self.log.read_text()[-3000:]}")

    def engine_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        # The engine is the spawned child; multiprocessing's resource tracker is a child too.
        pids = [int(p) for p in out if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert pids, f"no engine process under {self.proc.pid}"
        return pids[0]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.base_url}/metrics").text)

    def stop_checking_the_engine_never_died(self) -> None:
        """Stop; fail if the engine died while the server ran. A restart keeps a server serving, so without this a
        crash that a test's requests caused (a bug, not the test's subject) would go unseen."""
        deaths = self.metrics()["harpoon:engine_deaths_total"]
        self.stop()
        assert deaths == 0, f"the engine died {deaths:.0f} times while the tests ran:\n{self.log.read_text()[-3000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
