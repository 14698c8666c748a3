"""A reasoning model served with ``--reasoning-parser``: the thinking in ``reasoning_content``, whole and streamed
alike, a thinking budget kept to the token, and the new fields' bad values refused by name. The model is a tiny
random Llama whose tokenizer has ``<think>`` and ``</think>`` as tokens and whose template opens the thinking
(DeepSeek-R1's, tests/data/chat_templates)."""

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import build_tiny_model
from tests.server_process import ServerProcess

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
GENERATION = {"temperature": 0.7, "top_k": 1, "max_new_tokens": 20}  # the checkpoint's sampling defaults


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer):
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = (TEMPLATES / "deepseek_r1.jinja").read_text()
    folder = build_tiny_model("llama-gqa-tied", tmp_path_factory.mktemp("reasoning"), tokenizer,
                              vocab_size=len(tokenizer))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, **GENERATION}))
    s = ServerProcess("--model", str(folder), "--reasoning-parser", "deepseek_r1", "--max-model-len", "256")
    yield s
    s.stop()


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "temperature": 0, "max_tokens": 24, "skip_special_tokens": False,
                            **body})


def streamed(server, **body) -> tuple[str, str, list[str]]:
    reasoning, content, finish = "", "", []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "temperature": 0, "max_tokens": 24, "stream": True,
                            "skip_special_tokens": False, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
            finish.append(choice["finish_reason"])
    return reasoning, content, finish


@pytest.mark.parametrize("budget", [0, 6])
def test_a_thinking_budget_gives_that_many_thinking_tokens_then_the_answer(server, budget):
    r = chat(server, thinking_token_budget=budget, logprobs=True)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    tokens = [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]
    assert tokens.index("</think>") == budget
    assert (message["reasoning_content"] or "") == "".join(tokens[:budget])
    assert message["content"] == "".join(tokens[budget + 1 :]) and message["content"]
    assert streamed(server, thinking_token_budget=budget)[:2] == ((message["reasoning_content"] or ""),
                                                                   message["content"])


def test_without_a_bound_the_thinking_runs_to_max_tokens(server):
    message = chat(server).json()["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]  # a random model never closes it
    assert chat(server, separate_reasoning=False).json()["choices"][0]["message"] == {
        "role": "assistant", "content": message["reasoning_content"]}
    hidden = chat(server, include_reasoning=False, thinking_token_budget=3).json()["choices"][0]["message"]
    assert hidden["reasoning_content"] is None and hidden["content"]


@pytest.mark.parametrize("body, param", [
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": "5"}, "thinking_token_budget"),
    ({"thinking_deadline_ms": 0}, "thinking_deadline_ms"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_bad_thinking_fields_get_a_400_naming_them(server, body, param):
    r = chat(server, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_checkpoints_sampling_defaults_fill_what_a_request_leaves_out(server):
    card = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {"temperature": 0.7, "top_k": 1, "max_tokens": 20}
    body = {"messages": MESSAGES, "thinking_token_budget": 4, "seed": None}
    answers = [httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json() for _ in range(3)]
    assert all(a["usage"]["completion_tokens"] == 20 for a in answers)  # max_new_tokens
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1  # top_k 1: the same every call
    greedy = chat(server, thinking_token_budget=4, max_tokens=20, skip_special_tokens=True).json()
    assert greedy["choices"][0]["message"] == answers[0]["choices"][0]["message"]
    sampled = [chat(server, thinking_token_budget=4, top_k=0, temperature=1.0, max_tokens=20, seed=s).json()
               for s in range(3)]  # a request's own values win
    assert len({a["choices"][0]["message"]["content"] for a in sampled}) > 1


def test_responses_carry_the_thinking_as_a_reasoning_item(server):
    body = {"input": MESSAGES[0]["content"], "temperature": 0, "max_output_tokens": 24, "thinking_token_budget": 5}
    whole = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60).json()
    chat_message = chat(server, thinking_token_budget=5, skip_special_tokens=True).json()["choices"][0]["message"]
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == chat_message["reasoning_content"]
    assert whole["output"][1]["content"][0]["text"] == chat_message["content"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    events = []
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    thinking = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thinking == chat_message["reasoning_content"]
    assert events[-1]["type"] == "response.incomplete"  # max_output_tokens reached
    final = events[-1]["response"]
    assert [i["content"][0]["text"] for i in final["output"]] == [i["content"][0]["text"] for i in whole["output"]]
