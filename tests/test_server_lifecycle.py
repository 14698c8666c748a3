"""Server behaviour around the edges: API keys, admission limits, graceful shutdown and a dead engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

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
            in_flight = [asyncio.create_task(http.post("/v1/completions", json=LONG)) for _ in range(3)]
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
        assert all(d.json()["usage"]["completion_tokens"] == LONG["max_tokens"] for d in done)
        assert server.proc.wait(30) == 0
        # Both processes, the server's and the engine's, froze their start-up heaps once ready.
        assert server.log.read_text().count("objects kept out of garbage collection") == 2
    finally:
        server.stop()


def test_dead_engine_turns_health_503_and_fails_fast():
    server = ServerProcess("--max-model-len", "256")
    try:
        url = server.base_url
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(server.engine_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after the engine died"
            time.sleep(0.1)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - start < 2
        assert r.json()["error"]["type"] == "service_unavailable"
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_engine_death_mid_request_fails_the_request(stream):
    server = ServerProcess("--max-model-len", "512")
    try:
        body = {**LONG, "max_tokens": 400, "stream": stream}

        async def run() -> httpx.Response | str:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                task = asyncio.create_task(http.post("/v1/completions", json=body))
                await until_engine_reports(http, running=1, waiting=0)
                os.kill(server.engine_pid(), signal.SIGKILL)
                return await task

        r = asyncio.run(run())
        if stream:
            assert r.status_code == 200 and '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.status_code == 503
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
    from engine.cli import parse_engine_args

    assert parse_engine_args([]) == {}
    assert parse_engine_args(["--enforce-eager", "--no-prefix-caching", "--block-size", "32"]) == {
        "enforce_eager": True, "enable_prefix_caching": False, "block_size": 32}
