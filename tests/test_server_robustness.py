"""Nothing a client sends takes the server down: every bad input is a 4xx naming its field, an internal error is a
500 that leaves the connection usable, and oversized requests are refused before they cost memory."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from server.api import InternalErrorMiddleware, too_deep
from tests.server_process import free_port

MODEL = "SmolLM2-135M-Instruct"
BODY_LIMIT = 4 << 20


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def local_port(r: httpx.Response) -> int:
    """The client side's port of the connection that carried ``r``: the same port, the same connection."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_an_internal_error_is_a_500_and_the_connection_stays_usable():
    app = FastAPI()
    app.add_middleware(InternalErrorMiddleware)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaput")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    @app.get("/stream-boom")
    async def stream_boom() -> StreamingResponse:
        async def events():
            yield "data: 1\n\n"
            raise RuntimeError("mid-stream")

        return StreamingResponse(events(), media_type="text/event-stream")

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, port=port, log_level="critical"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        while not uv.started:
            time.sleep(0.01)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            first = http.get("/ok")
            r = http.get("/boom")
            assert r.status_code == 500
            assert r.json()["error"] == {"message": "internal error: RuntimeError: kaput",
                                         "type": "internal_server_error", "param": None, "code": None}
            r = http.get("/stream-boom")  # ended cleanly after what it sent
            assert r.status_code == 200 and r.text == "data: 1\n\n"
            last = http.get("/ok")
            assert last.status_code == 200 and local_port(last) == local_port(first)
    finally:
        uv.should_exit = True
        thread.join(10)


def test_echo_logprobs_of_a_cached_prompt_score_every_position_as_uncached(server):
    """Prompt logprobs need every prompt position's logits: a request for them skips the prefix cache, so its
    scores are the same whether the prompt was cached or not, and nothing else on the connection is harmed."""
    prompt = "Prompt logprobs ask for every position. " * 4  # several full blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 2, "temperature": 0}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        uncached = http.post("/v1/completions", json=body)
        assert http.post("/v1/completions", json={**body, "echo": False, "logprobs": None}).status_code == 200
        port = local_port(uncached)
        cached = http.post("/v1/completions", json=body)
        after = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert local_port(after) == port  # one connection throughout
    assert uncached.status_code == cached.status_code == after.status_code == 200
    a, b = uncached.json()["choices"][0]["logprobs"], cached.json()["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"] and a["token_logprobs"][0] is None
    assert len(a["token_logprobs"]) == uncached.json()["usage"]["prompt_tokens"] + 2
    for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:], strict=True):
        assert abs(x - y) <= 1e-4
    for x, y in zip(a["top_logprobs"][1:], b["top_logprobs"][1:], strict=True):
        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-4 for k in x)


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_BODIES = [  # (path, raw JSON body, status, param)
    ("/v1/completions", '{"prompt": ' + nested(100_000) + "}", 400, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ' + nested(70, '"x"') + "}", 400, "stop"),
    ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": "@"}}}).replace('"@"', '{"a": ' * 5000 + "1" + "}" * 5000), 400,
     "response_format"),
    ("/v1/chat/completions", json.dumps({**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "@"}}]}).replace('"@"', '{"a": ' * 80 + "1" + "}" * 80), 400, "tools"),
    ("/v1/completions", json.dumps({"prompt": "hi", "seed": 2**80}), 400, "seed"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(1000)]}), 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "2"}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "0.5"}), 400, "temperature"),
    ("/v1/completions", json.dumps({"prompt": "hi", "echo": 1}), 400, "echo"),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 1000}), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 3, "best_of": 2}), 400, "best_of"),
    ("/v1/completions", json.dumps({"prompt": "hi", "best_of": 1000}), 400, "best_of"),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}), 400, "best_of"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stream_options": {"include_usage": True}}), 400,
     "stream_options"),
    ("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"x": 1}}), 400, "logit_bias"),
    ("/v1/chat/completions", json.dumps({**CHAT, "top_logprobs": 2}), 400, "top_logprobs"),
    ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {"type": "json_schema"}}), 400,
     "response_format"),
    ("/v1/completions", json.dumps({"prompt": "a " * 1_000_000}), 400, "prompt"),  # cannot fit: refused unread
    ("/v1/completions", json.dumps({"prompt": "a " * 330_000}), 400, "prompt"),  # its prefix is already too long
    ("/v1/completions", json.dumps({"prompt": list(range(10_000))}), 400, "prompt"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": "a " * 1_000_000}]}),
     400, "messages"),
    ("/tokenize", json.dumps({"prompt": "a " * 1_000_000}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "a " * 2_500_000}), 413, None),  # over the body limit
    ("/v1/completions", json.dumps({"prompt": "hi", "no_stop_trim": True}), 400, "no_stop_trim"),
    ("/v1/chat/completions", json.dumps({**CHAT, "return_hidden_states": True}), 400, "return_hidden_states"),
]


def test_bodies_as_sglang_router_forwards_them_are_served(server):
    """sglang-router (the replicas profile) rewrites each body with SGLang's own fields at their defaults, as
    captured from version 0.3.2: they ask for nothing, so they are served."""
    completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": False, "echo": False,
                  "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                  "return_hidden_states": False}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "model": MODEL, "logprobs": False,
            "max_completion_tokens": 4, "stream": False, "no_stop_trim": False, "ignore_eos": False,
            "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
            "stream_reasoning": True, "return_hidden_states": False}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_BODIES,
                         ids=[f"{i}-{b[:40]}" for i, (_, b, _, _) in enumerate(BAD_BODIES)])
def test_bad_bodies_get_a_4xx_naming_their_field(server, path, body, status, param):
    r = httpx.post(f"{server.base_url}{path}", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_the_server_serves_on_after_bad_bodies(server):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_best_of_returns_the_n_samples_of_highest_mean_logprob(server):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 1.0, "seed": 11,
            "ignore_eos": True}
    every = httpx.post(f"{server.base_url}/v1/completions", json={**body, "n": 4, "logprobs": 0}).json()
    best = httpx.post(f"{server.base_url}/v1/completions", json={**body, "n": 2, "best_of": 4}).json()
    ranked = sorted(every["choices"], key=lambda c: -sum(c["logprobs"]["token_logprobs"]) / 6)
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 4 * 6  # every sample was generated


def test_too_deep_names_the_top_level_field():
    assert too_deep({"a": [[[1]]], "b": {"c": {"d": [1]}}}, 4) is None  # the body is level 1
    assert too_deep({"a": [[[1]]], "b": {"c": {"d": [[1]]}}}, 4) == "b"
