"""What clients send, at random, against a real server: request bodies built from the API's fields with right and
wrong values (hypothesis), and hundreds of clients that leave at random moments. Every answer is a 2xx or a 4xx with
OpenAI's error JSON, the server keeps serving, and afterwards no KV block is held."""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-num-seqs", "16", "--max-model-len", "1024", "--max-waiting-requests", "64",
                      "--kv-cache-memory", "1GiB")  # 16 x 1024 tokens: no preemption
    yield s
    s.stop_checking_the_engine_never_died()


def pool_is_free(server: ServerProcess, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["harpoon:num_requests_running"], m["harpoon:num_requests_waiting"], m["harpoon:kv_cache_usage_perc"]
                ) == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"blocks still held: {m}"
        time.sleep(0.1)


# ---- request bodies ------------------------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=12))
any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
small_int = st.integers(-3, 12)
unit = st.floats(-0.5, 2.5, allow_nan=False)
token_ids = st.lists(st.integers(-5, 60_000), max_size=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
    optional={"content": st.text(max_size=30) | st.just([{"type": "text", "text": "hi"}]) | any_json,
              "name": st.text(max_size=5)}), max_size=3) | any_json
grammars = st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}},
                            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}])
SAMPLING = {
    "model": st.just(MODEL) | st.text(max_size=8), "n": small_int, "temperature": unit, "top_p": unit,
    "top_k": small_int, "min_p": unit, "seed": st.integers(-(2**64), 2**64), "max_tokens": small_int | any_json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6), "stop_token_ids": token_ids,
    "presence_penalty": unit, "frequency_penalty": unit, "repetition_penalty": unit,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "2", "x", "-4", "99999"]), unit, max_size=2),
    "ignore_eos": st.booleans() | any_json, "min_tokens": small_int, "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}) | any_json, "response_format": grammars | any_json,
    "structured_outputs": st.just({"choice": ["a", "b"]}) | st.just({"regex": "[0-9]+"}) | any_json,
    "unknown_field": any_json,
}
# Prompts of several blocks that come back: a later request for them meets the prefix cache.
REPEATED = st.sampled_from(["The tide came in over the flat sands and the gulls rose. " * 4,
                            "One, two, three, four, five, six, seven, eight, nine, ten. " * 5])
COMPLETION = {**SAMPLING, "prompt": st.text(max_size=40) | REPEATED | token_ids
              | st.lists(st.text(max_size=8), max_size=3) | any_json, "echo": st.booleans(), "logprobs": small_int,
              "best_of": small_int}
CHAT = {**SAMPLING, "messages": messages, "logprobs": st.booleans(), "top_logprobs": small_int,
        "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
        | any_json, "tool_choice": st.sampled_from(["none", "auto", "required"]) | any_json}
RESPONSES = {
    "model": st.just(MODEL) | st.text(max_size=8), "input": st.text(max_size=40) | messages | any_json,
    "instructions": st.text(max_size=20) | any_json, "max_output_tokens": small_int | any_json, "temperature": unit,
    "top_p": unit, "stream": st.booleans(), "store": st.booleans() | any_json,
    "previous_response_id": st.text(max_size=8) | any_json,
    "tools": st.just([{"type": "function", "name": "f", "parameters": {"type": "object"}}]) | any_json,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | any_json,
    "text": st.just({"format": {"type": "json_object"}}) | any_json, "reasoning": any_json,
    "thinking_token_budget": small_int, "unknown_field": any_json,
}
bodies = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries({}, optional=COMPLETION)),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries({}, optional=CHAT)),
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries({}, optional=RESPONSES)),
    st.tuples(st.just("/v1/embeddings"), st.fixed_dictionaries({}, optional={"input": st.text(max_size=9) | any_json,
                                                                             "dimensions": small_int})),
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={"prompt": st.text(max_size=20) | any_json,
                                                                         "messages": messages})),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries({}, optional={"tokens": token_ids | any_json})),
)


# JSON types each field takes (None: null, which every optional field accepts); anything else must be a 400 naming it
INT, FLOAT, BOOL, STR = (int,), (int, float), (bool,), (str,)
FIELD_TYPES = {
    "n": INT, "top_k": INT, "seed": INT, "max_tokens": INT, "min_tokens": INT, "best_of": INT, "top_logprobs": INT,
    "temperature": FLOAT, "top_p": FLOAT, "min_p": FLOAT, "presence_penalty": FLOAT, "frequency_penalty": FLOAT,
    "repetition_penalty": FLOAT, "ignore_eos": BOOL, "stream": BOOL, "echo": BOOL, "model": STR,
    "max_output_tokens": INT, "store": BOOL, "thinking_token_budget": INT,
}


def wrong_fields(path: str, body: dict) -> set[str]:
    """The fields of ``body`` that no server may accept: a wrong JSON type, or a name the API does not have."""
    wrong = set()
    for name, value in body.items():
        if name == "unknown_field":
            wrong.add(name)
        if name == "logprobs":  # an integer on completions, a boolean on chat
            types = BOOL if path == "/v1/chat/completions" else INT
        else:
            types = FIELD_TYPES.get(name)
        if types is not None and value is not None and (type(value) not in types):
            wrong.add(name)
    return wrong


REQUIRED = {"/v1/completions": {"prompt"}, "/v1/chat/completions": {"messages"}, "/tokenize": {"prompt"},
            "/detokenize": {"tokens"}, "/v1/responses": {"input"}, "/v1/embeddings": {"input", "model"}}


def check_answer(r: httpx.Response, wrong: set[str] = frozenset(), named: set[str] | None = None) -> None:
    """2xx or 4xx with OpenAI's error JSON. Where the body has ``wrong`` fields, a 400 whose param is one of
    ``named`` (a body with several faults may be answered for any of them)."""
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if wrong:
        assert r.status_code == 400 and r.json()["error"]["param"] in named, (wrong, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif r.headers["content-type"].startswith("text/event-stream") and "event: response." in r.text:
        last = json.loads(r.text.rstrip("\n").rsplit("\n", 1)[-1].removeprefix("data: "))  # the Responses events
        assert last["type"] in ("response.completed", "response.incomplete"), r.text[-300:]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
        for event in r.text.split("\n\n")[:-2]:
            payload = json.loads(event.removeprefix("data: "))
            assert "error" not in payload, payload
    else:
        assert isinstance(r.json(), dict)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(request=bodies, deep=st.none() | st.tuples(st.integers(65, 3000), st.sampled_from(["stop", "prompt",
                                                                                             "logit_bias"])))
@example(request=("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "a", "extra": {"@": None}}),
         deep=(65, "stop"))  # a key that was once the test's own mark for the deep field
def test_random_bodies_get_2xx_or_4xx_json(server, request, deep):
    """Random bodies; now and then one field nested past the limit, which must be the 400's param."""
    path, body = request
    content = json.dumps(body)
    wrong = wrong_fields(path, body)
    named = set(body) | REQUIRED[path]
    if deep is not None:  # refused as the body is parsed, before any other check: this field and no other
        depth, field = deep
        body = {k: v for k, v in body.items() if k != field}
        mark = f"deep-{uuid.uuid4().hex}"  # a string no generated key or value is (one of them was "@")
        content = json.dumps({**body, field: mark}).replace(f'"{mark}"', "[" * depth + "]" * depth)
        wrong = named = {field}
    r = httpx.post(f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"},
                   timeout=120)
    check_answer(r, wrong, named)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_random_bytes_get_a_4xx(server, raw):
    r = httpx.post(f"{server.base_url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    check_answer(r)


def test_the_server_serves_on_after_the_fuzz(server):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    pool_is_free(server)


# ---- clients that leave ---------------------------------------------------------------------------------------------
async def client_that_leaves(http: httpx.AsyncClient, rng: random.Random) -> str:
    """A request that is abandoned at a random moment: queued, prefilling a long prompt, decoding, or after it
    finished; streamed or not."""
    words = rng.randint(1, 350)  # up to ~350 tokens: prefill chunks beside decodes
    body = {"model": MODEL, "prompt": " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(words)),
            "max_tokens": rng.randint(1, 120), "ignore_eos": True, "stream": rng.random() < 0.5,
            "n": rng.choice([1, 1, 1, 2])}
    patience = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0, 3.0, None])  # None: stays to the end, however slow the machine
    try:
        if body["stream"]:
            async with asyncio.timeout(patience):
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        else:
            await http.post("/v1/completions", json=body, timeout=0.001 if patience == 0 else patience)
    except (TimeoutError, httpx.TimeoutException):
        return "left"
    return "finished"


async def test_hundreds_of_clients_leaving_at_random_leak_no_block(server):
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as http:
        outcomes = await asyncio.gather(*(client_that_leaves(http, rng) for _ in range(200)))
    assert outcomes.count("left") >= 100 and outcomes.count("finished") >= 20, outcomes
    pool_is_free(server)
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200
