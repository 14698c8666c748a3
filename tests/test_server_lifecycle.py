"""Server behaviour around the edges: API keys, admission limits, graceful shutdown and a dead engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, parse_metrics

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 100, "ignore_eos": True}


async def until_engine_reports(http: httpx.AsyncClient, running: int, waiting: int) -> None:
    """Waits until the engine's latest step had this many requests running and waiting: a fixed sleep instead lets
    a fast machine finish the requests before the test acts on them."""
    deadline = time.monotonic() + 30
    while True:
        m = parse_metrics((await http.get("/metrics")).text)
        if (m.get("harpoon:num_requests_running"), m.get("harpoon:num_requests_waiting")) == (running, waiting):
            return
        assert time.monotonic() < deadline, f"the engine never reported {running} running, {waiting} waiting: {m}"
        await asyncio.sleep(0.02)


async def test_api_key_admission_limit_and_sigterm_drain():
    server = ServerProcess("--api-key", "sekret", "--max-num-seqs", "2", "--max-waiting-requests", "1",
                           "--shutdown-timeout", "60", "--log-level", "info")
    try:
        url = server.base_url
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        auth = {"Authorization": "Bearer sekret"}

        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as http:
            # 2 running + 1 waiting fit; a fourth is turned away with 429 and Retry-After. It is sent once the
            # engine reports all three admitted, while they have most of their tokens still to go.
            bodies = [LONG, LONG, {**LONG, "stream": True}]  # a drain sends a stream to its end too
            in_flight = [asyncio.create_task(http.post("/v1/completions", json=body)) for body in bodies]
            await until_engine_reports(http, running=2, waiting=1)
            r = await http.post("/v1/completions", json=LONG)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_exceeded"

            # SIGTERM while they run: new requests get 503, the running ones still finish, then a clean exit.
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 503
            done = await asyncio.gather(*in_flight)
        assert [d.status_code for d in done] == [200, 200, 200]
        assert all(d.json()["usage"]["completion_tokens"] == LONG["max_tokens"] for d in done[:2])
        events = done[2].text.split("\n\n")
        assert events[-2] == "data: [DONE]" and len(events) - 2 == LONG["max_tokens"]
        assert server.proc.wait(30) == 0
        # Both processes, the server's and the engine's, froze their start-up heaps once ready.
        assert server.log.read_text().count("objects kept out of garbage collection") == 2
    finally:
        server.stop()


def wait_served(url: str, timeout: float) -> float:
    """Seconds until a completion is answered 200 again; every answer before it must be a fast 503."""
    start = time.monotonic()
    while True:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
        if r.status_code == 200:
            return time.monotonic() - start
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        assert r.headers["retry-after"]
        assert time.monotonic() - start < timeout, f"not serving {timeout:.0f} s after the engine died"
        time.sleep(0.2)


def test_an_engine_that_cannot_start_exits_the_server_non_zero_with_the_reason():
    with pytest.raises(RuntimeError) as info:
        ServerProcess("--max-model-len", "100000")
    message = str(info.value)
    assert "exited with 1" in message and "the engine could not start" in message
    assert "exceeds what the model supports" in message


def test_an_engine_killed_mid_request_fails_it_and_is_replaced_and_repeated_deaths_back_off():
    """SIGKILL the engine (what the OOM killer does) while it serves a request, once not streamed, then streamed:
    the request fails with the retryable 503 error (in the stream, as its last event), /health turns 503 and new
    requests get a 503 at once while a new engine starts, and completions are answered again well within 90 s. The
    second death, soon after the first, waits out a back-off; both are counted. (One server for both deaths: each
    engine start costs the suite ~9 s on the slow CPUs.)"""
    server = ServerProcess("--max-model-len", "512", "--log-level", "info")
    try:
        url = server.base_url
        pids = []
        for stream in (False, True):
            body = {**LONG, "max_tokens": 400, "stream": stream}

            async def run(body=body) -> httpx.Response:
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    task = asyncio.create_task(http.post("/v1/completions", json=body))
                    await until_engine_reports(http, running=1, waiting=0)
                    pids.append(server.engine_pid())
                    os.kill(pids[-1], signal.SIGKILL)
                    return await task

            r = asyncio.run(run())
            if stream:
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
                error = json.loads(r.text.split("data: ")[-2])["error"]
            else:
                assert r.status_code == 503 and r.headers["retry-after"]
                error = r.json()["error"]
            assert error["type"] == "service_unavailable" and "the request was lost, retry it" in error["message"], \
                stream
            health = httpx.get(f"{url}/health")  # the request failed once the death was known
            assert health.status_code == 503
            assert "SIGKILL" in health.json()["error"]["message"]
            assert "new engine is starting" in health.json()["error"]["message"]
            m = server.metrics()  # the lost request is not counted as running, now or once a new engine serves
            assert (m["harpoon:num_requests_running"], m["harpoon:kv_cache_usage_perc"]) == (0, 0), m
            assert wait_served(url, 90) < 90  # and the server goes on, on a new engine
        assert len(set(pids + [server.engine_pid()])) == 3
        m = server.metrics()
        assert m["harpoon:engine_deaths_total"] == 2 and m["harpoon:engine_restarts_total"] == 2
        assert m["harpoon:engine_up"] == 1
        log = server.log.read_text()
        assert "starting a new engine in 0 s" in log and "starting a new engine in 1 s" in log
    finally:
        server.stop()


@pytest.mark.parametrize("flags,message", [
    (["--prefill-tokens-per-decode", "-1"], "prefill_tokens_per_decode must be >= 0, got -1.0"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
    (["--kv-cache-memory", "1.5"], "kv_cache_memory as a fraction must be in (0, 1]"),
])
def test_bad_engine_flags_are_usage_errors_before_any_model_loads(flags, message, capsys, monkeypatch):
    import server.cli

    def no_model(_):
        raise AssertionError("resolved a model for a command line that was already wrong")

    monkeypatch.setattr(server.cli, "resolve_model", no_model)
    with pytest.raises(SystemExit) as exit_info:
        server.cli.main(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: harpoon serve") and message in err


def test_switch_flags_set_only_what_they_name():
    from engine.arg_utils import parse_engine_args

    assert parse_engine_args([]) == {}
    assert parse_engine_args(["--enforce-eager", "--no-prefix-caching", "--block-size", "32"]) == {
        "enforce_eager": True, "enable_prefix_caching": False, "block_size": 32}


def test_the_serve_command_imports_no_heavy_module_before_the_engine_starts():
    """``harpoon serve`` spawns the engine process before it imports torch, transformers or FastAPI (they load while
    the engine loads the model), and spawn imports the command's module again in the engine process."""
    heavy = ("torch", "transformers", "fastapi", "numpy")
    code = f"import sys, server.cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]"
