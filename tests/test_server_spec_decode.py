"""A server with n-gram speculative decoding: streamed and whole responses carry transformers' greedy text, several
tokens arriving per step, and a stop string met inside a step's tokens cuts the text exactly there. The same server
reads tool calls with the hermes parser (tool_choice "auto"), several tokens of a tag arriving at once."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import hf_greedy
from tests.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. Again:"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--speculative-config", '{"num_speculative_tokens": 4, "disable_by_batch_size": null}',
                      "--max-num-batched-tokens", "128", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop_checking_the_engine_never_died()


@pytest.fixture(scope="module")
def expected_text(hf_smollm2, smollm2_tokenizer) -> str:
    ids = hf_greedy(hf_smollm2, smollm2_tokenizer.encode(PROMPT), MAX_TOKENS)
    return smollm2_tokenizer.decode(ids, skip_special_tokens=True)


def complete(server: ServerProcess, stream: bool, **extra) -> tuple[str, list[str], dict]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, **extra}
    if not stream:
        data = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
        return data["choices"][0]["text"], [], data["choices"][0]
    pieces, last = [], {}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    pieces.append(chunk["choices"][0]["text"])
                    last = chunk["choices"][0]
    return "".join(pieces), pieces, last


def test_greedy_text_equals_transformers_with_drafts_accepted(server, expected_text):
    text, _, _ = complete(server, stream=False)
    streamed, pieces, _ = complete(server, stream=True)
    assert text == streamed == expected_text
    m = server.metrics()
    assert m["harpoon:spec_decode_num_accepted_tokens_total"] > 0
    assert m["harpoon:spec_decode_num_draft_tokens_total"] >= m["harpoon:spec_decode_num_accepted_tokens_total"]
    assert len(pieces) < MAX_TOKENS  # accepted drafts arrive together: fewer chunks than tokens


def test_stop_string_inside_accepted_drafts(server, expected_text):
    stop = expected_text[len(expected_text) // 2 :][:7]
    cut = expected_text[: expected_text.index(stop)]
    for stream in (False, True):
        text, _, last = complete(server, stream=stream, stop=[stop])
        assert text == cut
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_auto_tool_calls_read_by_the_hermes_parser(server):
    """The model is held to a hermes-style call by a regex (a request's own structured outputs stay allowed with
    "auto"), so the parser meets real streamed text: the same call whole and streamed, finish reason tool_calls."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [tool], "max_tokens": 120, "temperature": 0, "structured_outputs": {"regex": (
                r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}'
                r"\n</tool_call>")}}
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Checking.\n"
    [call] = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]).keys() == {"city"}

    content, calls, finish = "", [], None
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls", [])
                finish = choice["finish_reason"] or finish
    assert content == "Checking.\n" and finish == "tool_calls"
    assert [(c["index"], c["function"]) for c in calls] == [(0, call["function"])]
