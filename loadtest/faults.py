"""What bad input and injected faults do to a running server: the reliability table of docs/reliability.md.

    python -m loadtest.faults [--save results/faults.json] [-- harpoon serve flags...]

Starts ``harpoon serve`` (default model) on a free port and, while one stream decodes beside it, sends each bad
input once, recording the status, the error's param, the time to answer and the stream's longest gap meanwhile
(bodies are encoded before the stream starts, so the client's own JSON work does not show as a gap). Then it injects
faults, one at a time, with streams in flight: SIGKILL of the engine (what the OOM killer does), a second SIGKILL
soon after the first (the back-off), SIGSTOP of the engine (a stall, found by the watchdog), and SIGTERM of the
server (the drain). For each: what the requests in flight got, and the seconds until a completion is answered again
(or, for SIGTERM, until the process exited and with what code). Last, the API process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

MODEL_PROMPT = {"prompt": "Tell me a long story about the sea.", "ignore_eos": True}


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD_INPUTS: list[tuple[str, str, str]] = [  # (what, path, raw body)
    ("prompt of 100k nested arrays", "/v1/completions", '{"prompt": ' + _nest(100_000) + "}"),
    ("response_format schema nested 5000 deep", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": '
     '{"name": "a", "schema": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}}}"),
    ("seed 2**80", "/v1/completions", json.dumps({"prompt": "hi", "seed": 2**80})),
    ("1000 stop strings", "/v1/completions", json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(1000)]})),
    ('max_tokens "2" (a string)', "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "2"})),
    ("n 1000", "/v1/completions", json.dumps({"prompt": "hi", "n": 1000})),
    ("an unknown field", "/v1/completions", json.dumps({"prompt": "hi", "frobnicate": 1})),
    ("malformed JSON", "/v1/completions", '{"prompt": "hi",'),
    ("token ids out of the vocabulary", "/v1/completions", json.dumps({"prompt": [10**9]})),
    ("a 6 MB prompt (3M tokens)", "/v1/completions", json.dumps({"prompt": "a " * 3_000_000})),
    ("a 660k-character prompt (330k tokens)", "/v1/completions", json.dumps({"prompt": "a " * 330_000})),
    ("a 20 MB body", "/v1/completions", json.dumps({"prompt": "a " * 10_000_000})),
    ("echo + logprobs of a cached prompt", "/v1/completions",
     json.dumps({"prompt": "Cached prefix, scored again. " * 8, "max_tokens": 2, "echo": True, "logprobs": 2})),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "--port", str(self.port), *flags],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.wait_healthy(600)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def engine_pid(self) -> int:
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return next(int(p) for p in children if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text())

    def peak_rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024


class Stream(threading.Thread):
    """A streamed completion read on its own thread: the gaps between its events, and how it ended."""

    def __init__(self, url: str, max_tokens: int = 4000) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.gaps: list[float] = []
        self.ended = ""
        self.stop = threading.Event()
        self.started = threading.Event()

    def run(self) -> None:
        body = {**MODEL_PROMPT, "max_tokens": self.max_tokens, "stream": True}
        last = None
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append(now - last)
                    last = now
                    self.started.set()
                    if line == "data: [DONE]":
                        self.ended = self.ended or "[DONE]"
                    elif "error" in (event := json.loads(line[6:])):
                        self.ended = "error event: " + event["error"]["message"][:90]
                    if self.stop.is_set():
                        self.ended = "left"
                        return
        except httpx.HTTPError as e:
            self.ended = f"{type(e).__name__}"


def bad_inputs(server: Server) -> list[dict]:
    rows = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        http.post("/v1/completions", json={"prompt": "Cached prefix, scored again. " * 8, "max_tokens": 1})
        for what, path, body in BAD_INPUTS:
            content = body.encode()
            stream = Stream(server.url)
            stream.start()
            stream.started.wait(60)
            time.sleep(0.5)
            start = time.monotonic()
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            seconds = time.monotonic() - start
            time.sleep(0.5)
            stream.stop.set()
            stream.join(30)
            error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            after = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code
            rows.append({"input": what, "body_bytes": len(content), "status": r.status_code,
                         "param": error and error["param"], "message": error and error["message"][:100],
                         "seconds": round(seconds, 3), "stream_max_gap_ms": round(1000 * max(stream.gaps), 1),
                         "stream_p50_gap_ms": round(1000 * sorted(stream.gaps)[len(stream.gaps) // 2], 1),
                         "next_request": after})
            print(f"{what}: {r.status_code} param={error and error['param']} in {seconds:.2f} s, stream max gap "
                  f"{rows[-1]['stream_max_gap_ms']} ms", flush=True)
    return rows


def time_to_serve(url: str, since: float, timeout: float = 300) -> float:
    while time.monotonic() - since < timeout:
        try:
            if httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10
                          ).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return float("inf")


def streams_under_way(url: str, count: int, max_tokens: int) -> list[Stream]:
    """``count`` streams, each once its first token arrived."""
    streams = [Stream(url, max_tokens=max_tokens) for _ in range(count)]
    for s in streams:
        s.start()
    for s in streams:
        s.started.wait(60)
    return streams


def inject(server: Server, name: str, act) -> dict:  # noqa: ANN001 (act: the fault, given the server)
    streams = streams_under_way(server.url, 4, max_tokens=400)
    start = time.monotonic()
    act(server)
    for s in streams:
        s.join(120)
    serve_again = time_to_serve(server.url, start)
    row = {"fault": name, "in_flight": len(streams), "in_flight_got": sorted({s.ended for s in streams}),
           "seconds_to_serve_again": round(serve_again, 1)}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--log", type=Path, default=Path("/tmp/harpoon-faults-server.log"))
    parser.add_argument("flags", nargs="*", help="harpoon serve flags (after --)")
    args = parser.parse_args(argv)
    flags = ["--health-stall-timeout", "10", "--log-level", "info", *args.flags]
    server = Server(flags, args.log)
    try:
        rows = bad_inputs(server)
        faults = [
            inject(server, "SIGKILL the engine", lambda s: os.kill(s.engine_pid(), signal.SIGKILL)),
            inject(server, "SIGKILL the new engine at once", lambda s: os.kill(s.engine_pid(), signal.SIGKILL)),
            inject(server, "SIGSTOP the engine (a stall; --health-stall-timeout 10)",
                   lambda s: os.kill(s.engine_pid(), signal.SIGSTOP)),
        ]
        rss = server.peak_rss_mib()
        streams = streams_under_way(server.url, 4, max_tokens=200)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(120)
        for s in streams:
            s.join(10)
        faults.append({"fault": "SIGTERM the server (drain)", "in_flight": 4,
                       "in_flight_got": sorted({s.ended for s in streams}), "exit_code": code,
                       "seconds_to_exit": round(time.monotonic() - start, 1)})
        print(faults[-1])
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    print(f"API process peak RSS: {rss:.0f} MiB")
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps({"bad_inputs": rows, "faults": faults, "api_peak_rss_mib": rss}, indent=2))


if __name__ == "__main__":
    main()
