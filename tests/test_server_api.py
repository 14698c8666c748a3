"""The server against the official openai SDK and raw httpx, on a real uvicorn process serving the default model."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.conftest import PROMPTS
from tests.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(shared_client):
    return shared_client


def wait_pool_free(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["harpoon:num_requests_running"] == 0 and m["harpoon:num_requests_waiting"] == 0
        if idle and m["harpoon:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"pool not free: {m}")
        time.sleep(0.1)


def test_models_health_and_tokenize(server):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/debug/kv").status_code == 404  # debug routes are off unless asked for
    assert httpx.get(f"{server.base_url}/dashboard").status_code == 404
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 8192
    tok = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_completion_single_batch_and_token_prompts(client):
    one = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert one.object == "text_completion" and one.model == MODEL
    assert one.choices[0].text.strip().startswith("Paris")
    assert one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == 8 and one.usage.total_tokens == one.usage.prompt_tokens + 8

    batch = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=8,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == one.choices[0].text

    ids = httpx.post(f"{client.base_url.scheme}://{client.base_url.host}:{client.base_url.port}/tokenize",
                     json={"prompt": "The capital of France is"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == one.choices[0].text
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert len(lists.choices) == 2


def test_n_seed_stop_logprobs_echo(client):
    two = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, n=2, seed=7,
                                    temperature=1.0)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, n=2, seed=7,
                                      temperature=1.0)
    assert [c.text for c in two.choices] == [c.text for c in again.choices]
    assert two.choices[0].text != two.choices[1].text
    assert two.usage.completion_tokens == 24

    full = client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=24, temperature=0).choices[0].text
    stop = full.split()[3]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"

    lp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                   logprobs=2).choices[0]
    assert len(lp.logprobs.tokens) == 4 and "".join(lp.logprobs.tokens) == lp.text
    assert all(v <= 0 for v in lp.logprobs.token_logprobs)
    assert all(len(top) >= 2 for top in lp.logprobs.top_logprobs)
    assert lp.logprobs.text_offset[0] == 0

    echo = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                     echo=True, logprobs=1).choices[0]
    assert echo.text == "The capital of France is" + lp.text
    assert echo.logprobs.token_logprobs[0] is None and len(echo.logprobs.tokens) == 5 + 4


def test_chat_whole_and_streamed(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert "Paris" in text

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == whole.choices[0].finish_reason

    plain = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)

    lp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                        top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_structured_outputs(client, server):
    """response_format (OpenAI's) and structured_outputs (vLLM's): the output parses, whole and streamed."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"]}
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                           response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    assert json.loads(whole.choices[0].message.content).keys() == {"city", "country"}
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content

    anything = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0.8,
                                              seed=3, response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    picked = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=1.0, n=3,
                                       extra_body={"structured_outputs": {"choice": ["blue", "green", "grey"]}})
    assert all(c.text in ("blue", "green", "grey") and c.finish_reason == "stop" for c in picked.choices)
    wait_pool_free(server)


def test_logprobs_of_tokens_a_grammar_rules_out_are_the_floor_not_a_500(server):
    """More top logprobs than the grammar allows tokens: the rest are -inf, which JSON cannot hold; they come back
    as -9999.0 (vLLM's floor), whole and streamed, completions and chat (a body the fuzz test found)."""
    choice = {"structured_outputs": {"choice": ["a", "b"]}, "temperature": 0, "model": MODEL}
    for stream in (False, True):
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={**choice, "prompt": "0", "logprobs": 2, "stop": "0", "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            tops = [top for e in events for c in e["choices"] if c["logprobs"] for top in c["logprobs"]["top_logprobs"]]
        else:
            tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        values = [v for top in tops for v in top.values()]
        assert -9999.0 in values and all(-9999.0 <= v <= 0 for v in values), tops
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json={**choice, "messages": [{"role": "user", "content": "a or b?"}], "logprobs": True,
                         "top_logprobs": 3})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    values = [t["logprob"] for entry in content for t in entry["top_logprobs"]]
    assert -9999.0 in values and all(-9999.0 <= v <= 0 for v in values), content
    wait_pool_free(server)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


def test_tool_calls(client, server):
    """A named function and "required": the calls parse and name the tools, whole and streamed alike, and the
    conversation goes on with the calls and a tool's answer in it, as an agent loop sends them."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model=MODEL, messages=messages, max_tokens=80, temperature=0, tools=[WEATHER, CLOCK])
    named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments).keys() == {"city"}

    required = client.chat.completions.create(**ask, tool_choice="required")
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls)
    assert len({c.id for c in choice.message.tool_calls}) == len(calls)

    streamed: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, tool_choice="required", stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta_call.index, ["", ""])
            entry[0] += delta_call.function.name or ""
            entry[1] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls and finish == "tool_calls"

    answer = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "Sunny, 22 C"}
    follow = client.chat.completions.create(model=MODEL, messages=[*messages, choice.message, answer], max_tokens=5,
                                            temperature=0, tools=[WEATHER, CLOCK], tool_choice="none")
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
    wait_pool_free(server)


def test_chat_template_options(client):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs."""
    question = {"role": "user", "content": "What is the capital of France?"}
    opening = {"role": "assistant", "content": "The capital of France is"}
    cont = client.chat.completions.create(model=MODEL, messages=[question, opening], max_tokens=3, temperature=0,
                                          extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.choices[0].message.content.startswith(" Paris")
    plain = client.chat.completions.create(model=MODEL, messages=[question], max_tokens=1, temperature=0)
    bare = client.chat.completions.create(model=MODEL, messages=[question], max_tokens=1, temperature=0,
                                          extra_body={"add_generation_prompt": False,
                                                      "chat_template_kwargs": {"enable_thinking": False}})
    assert bare.usage.prompt_tokens < plain.usage.prompt_tokens  # no "<|im_start|>assistant" opened


def test_streaming_completion_sse_framing(server):
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 10, "temperature": 0, "stream": True,
            "stop": [" 7"], "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    text = "".join(p["choices"][0]["text"] for p in payloads if p["choices"])
    whole = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False,
                                                                  "stream_options": None}).json()
    assert text == whole["choices"][0]["text"]
    assert " 7" not in text
    assert payloads[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    # One chunk per token, also while text is held back (here: a possible start of " 7"), as vLLM streams.
    assert sum(1 for p in payloads if p["choices"]) == whole["usage"]["completion_tokens"]


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi " * 9000, "max_tokens": 10}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/completions", {"prompt": "hi", "suffix": "there"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     400, "response_format"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": True}, "min_tokens": 2}, 400,
     "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     400, "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}, 400,
     "tool_choice"),  # "auto", the default with tools, needs a tool-call parser
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, WEATHER],
                              "tool_choice": "required"}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
                              "tools": [{"type": "function", "function": {"name": "has space"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                  "type": "objectx"}}}]}, 400, "tools"),
    ("/v1/nowhere", {"prompt": "hi"}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = httpx.post(f"{server.base_url}{path}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_malformed_json_and_wrong_content_type(server):
    r = httpx.post(f"{server.base_url}/v1/completions", content=b'{"prompt": "hi",',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/v1/completions", content=b"prompt=hi",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type" in r.json()["error"]["message"]
    r = httpx.get(f"{server.base_url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    wait_pool_free(server)


async def _stream_then_leave(base_url: str, i: int) -> int:
    body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break  # leave mid-generation: the connection closes with the client
    return seen


async def test_disconnecting_stream_clients_free_everything(server):
    before = server.metrics()["harpoon:generation_tokens_total"]
    seen = await asyncio.gather(*(_stream_then_leave(server.base_url, i) for i in range(50)))
    assert all(s == 3 for s in seen)
    m = wait_pool_free(server)
    assert m["harpoon:generation_tokens_total"] - before < 50 * 200  # they were cut short, not run to the end


async def test_non_streaming_client_disconnect_aborts(server):
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post("/v1/completions", json=body, timeout=1.5)
    wait_pool_free(server)


async def test_greedy_same_alone_or_among_32_concurrent(server):
    target = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 24, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        alone = (await http.post("/v1/completions", json=target)).json()["choices"][0]["text"]
        others = [{"model": MODEL, "prompt": f"{PROMPTS[i % 8]} (variant {i})", "max_tokens": 16 + i,
                   "temperature": 0.8 if i % 2 else 0} for i in range(32)]
        calls = [http.post("/v1/completions", json=b) for b in others[:16]]
        calls.append(http.post("/v1/completions", json=target))
        calls += [http.post("/v1/completions", json=b) for b in others[16:]]
        results = await asyncio.gather(*calls)
    assert all(r.status_code == 200 for r in results)
    assert results[16].json()["choices"][0]["text"] == alone
    wait_pool_free(server)


def test_prefix_cache_hits_show_in_usage_and_metrics(server):
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 2, "temperature": 0}
    first = httpx.post(f"{server.base_url}/v1/completions", json=body).json()
    second = httpx.post(f"{server.base_url}/v1/completions", json=body).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16 > 0
    m = server.metrics()
    assert m["harpoon:prefix_cache_hits_total"] >= second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert m["harpoon:prefix_cache_queries_total"] >= 2 * prompt_tokens
