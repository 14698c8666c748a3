"""Two replicas behind sglang-router (the compose profile "replicas", loadtest/replicas.py): the router's bodies are
served, a prefix goes back to the replica that has it cached, and a replica killed as the OOM killer would is taken
out of rotation by the router's health checks while the other keeps serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server_process import ServerProcess, free_port

pytest.importorskip("sglang_router", reason="sglang-router is the 'router' extra (pip install -e '.[router]')")

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "You are the assistant of a shop that sells harpoons, ropes and boats. Answer briefly and politely. " * 4


@pytest.fixture(scope="module")
def cluster():
    replicas = [ServerProcess("--max-model-len", "1024", "--num-threads", "1", "--log-level", "warning", wait=False)
                for _ in range(2)]  # started side by side, a core each
    try:
        for r in replicas:
            r.wait_healthy()
    except Exception:
        for r in replicas:
            r.stop()
        raise
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *[r.base_url for r in replicas], "--policy", "cache_aware", "--prometheus-port",
         str(free_port()), "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
         "--health-check-timeout-secs", "2", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and router.poll() is None, "the router did not start"
        time.sleep(0.3)
    yield url, replicas
    router.send_signal(signal.SIGTERM)
    router.wait(30)
    for r in replicas:
        r.stop()


def served(replicas: list[ServerProcess]) -> list[float]:
    return [r.metrics().get("harpoon:e2e_request_latency_seconds_count", 0.0) for r in replicas]


def complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})


def test_a_prefix_returns_to_the_replica_that_has_it_cached(cluster):
    url, replicas = cluster
    first = complete(url, PREFIX + "Question: do you sell rope?")
    assert first.status_code == 200, first.text
    before = served(replicas)
    for i in range(4):
        r = complete(url, PREFIX + f"Question {i}: what does a boat cost?")
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = served(replicas)
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 4]  # all on the one with the prefix


def test_a_killed_replica_is_taken_out_and_the_other_keeps_serving(cluster):
    url, replicas = cluster
    victim, survivor = replicas
    os.kill(victim.engine_pid(), signal.SIGKILL)  # the OOM killer's way: the engine first
    victim.proc.kill()  # then the whole replica
    victim.proc.wait()
    deadline = time.monotonic() + 30
    while complete(url, PREFIX + "After the crash?").status_code != 200:  # until the router has noticed
        assert time.monotonic() < deadline, "the router kept sending requests to the dead replica"
        time.sleep(0.5)
    before = survivor.metrics()["harpoon:e2e_request_latency_seconds_count"]
    answers = [complete(url, PREFIX + f"Question {i} after the crash").status_code for i in range(8)]
    assert answers == [200] * 8
    assert survivor.metrics()["harpoon:e2e_request_latency_seconds_count"] - before == 8
