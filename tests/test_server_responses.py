"""POST /v1/responses through the official openai SDK on the default model: text and message input, instructions,
the event sequence of a stream (whose last event is the whole response), a function-call round trip through
previous_response_id and through the full input, structured text, stored responses, and bad fields by name."""

import json

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


def test_text_input_equals_the_same_chat(shared_client):
    response = shared_client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                       temperature=0, max_output_tokens=8)
    chat = shared_client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert response.status in ("completed", "incomplete") and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_message_input_and_the_stream_events(shared_client):
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Count to five:"}]}]
    whole = shared_client.responses.create(input=messages, temperature=0, max_output_tokens=12, model=MODEL)
    events = list(shared_client.responses.create(input=messages, temperature=0, max_output_tokens=12, stream=True,
                                          model=MODEL))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_a_function_call_round_trip(shared_client):
    first = shared_client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", temperature=0, max_output_tokens=40)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear", "c": 21}'}
    follow = shared_client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                     tool_choice="none", temperature=0, max_output_tokens=16)
    # the same turn sent whole, without the stored response
    full_input = [{"role": "user", "content": "What is the weather in Paris?"},
                  {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                   "arguments": calls[0].arguments}, result]
    again = shared_client.responses.create(model=MODEL, input=full_input, tools=[WEATHER], tool_choice="none",
                                           temperature=0,
                                    max_output_tokens=16)
    assert follow.output_text == again.output_text
    assert follow.usage.input_tokens == again.usage.input_tokens > first.usage.input_tokens


def test_structured_text_and_a_named_function(shared_client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    r = shared_client.responses.create(model=MODEL, input="Reply in JSON.", temperature=0, max_output_tokens=100,
                                text={"format": {"type": "json_schema", "name": "reply", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"answer"}
    named = shared_client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    assert [i.type for i in named.output] == ["function_call"] and named.output[0].name == "get_weather"


def test_stored_responses_are_kept_and_can_be_refused(shared_server, shared_client):
    r = shared_client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=4)
    assert shared_client.responses.retrieve(r.id).output_text == r.output_text
    unstored = shared_client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        shared_client.responses.create(model=MODEL, input="again", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": "x", "temperature": 5}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "thinking_token_budget": 3}, "thinking_token_budget"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": []}, "input"),
])
def test_bad_fields_get_a_400_naming_them(shared_server, body, param):
    r = httpx.post(f"{shared_server.base_url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
