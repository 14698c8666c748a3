"""Reasoning parsers and the tool parsers that came with them, read from what each family's chat template writes
(tests/data/chat_templates, from the families' published formats): the assistant turn a template renders for a
message is what the model was trained to write, so parsing it must give the message back, whole and under every
way a stream can cut the text (no model)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.chat_reader import ChatReading
from server.reasoning import REASONING_PARSERS
from server.tool_calls import plan_tools

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": "object"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALLS = [{"id": "call00001", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris, \"FR\"", "days": 3,
                                                            "units": {"temp": "C"}}}},
         {"id": "call00002", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
USER = {"role": "user", "content": "Weather in Paris, and the time?"}


def render(tokenizer, family: str, messages: list[dict], generation_prompt: bool, **kwargs) -> str:
    template = (TEMPLATES / f"{family}.jinja").read_text()
    return tokenizer.apply_chat_template(messages, chat_template=template, tools=[WEATHER, TIME], tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)


def assistant_turn(tokenizer, family: str, message: dict, end: str, **kwargs) -> tuple[str, str]:
    """The prompt, and what the model writes after it for ``message`` (the template's rendering, less the end of
    its turn, which the engine's stop token ends)."""
    prompt = render(tokenizer, family, [USER], True, **kwargs)
    whole = render(tokenizer, family, [USER, message], False, **kwargs)
    assert whole.startswith(prompt.rstrip("\n")), (prompt, whole)
    output = whole[len(prompt) :] if whole.startswith(prompt) else whole[len(prompt.rstrip("\n")) :]
    assert output.endswith(end), output
    return prompt, output[: len(output) - len(end)]


def read(reading: ChatReading, text: str, cuts: list[int]) -> tuple[str, str, list[dict]]:
    """``text`` fed in pieces, put together as a client does; checked against one whole feed."""
    reader = reading.reader()
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    content, reasoning, calls = "", "", {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        delta = reader.feed(text[a:b], final=k == len(bounds) - 2)
        content += delta.content
        reasoning += delta.reasoning
        for call in delta.tool_calls:
            entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
    whole_content, whole_reasoning, whole_calls = reading.whole(text)
    assert (whole_content or "", whole_reasoning or "") == (content, reasoning)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == \
        [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    return content, reasoning, [{"name": calls[i]["name"], "arguments": json.loads(calls[i]["arguments"])}
                                for i in sorted(calls)]


cut_points = st.lists(st.integers(min_value=1, max_value=400), max_size=14)
EXPECTED_CALLS = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in CALLS]


def auto(parser: str) -> object:
    return plan_tools([WEATHER, TIME], "auto", True, parser)


# ---- reasoning ---------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(cuts=cut_points)
def test_qwen3_thinking_the_model_opens(smollm2_tokenizer, cuts):
    message = {"role": "assistant", "reasoning_content": "The user wants <b>weather</b>.", "content": "It is sunny."}
    prompt, output = assistant_turn(smollm2_tokenizer, "qwen3", message, "<|im_end|>\n")
    reading = ChatReading(None, REASONING_PARSERS["qwen3"], prompt)
    content, reasoning, _ = read(reading, output, cuts)
    assert (reasoning.strip(), content.strip()) == ("The user wants <b>weather</b>.", "It is sunny.")


def test_qwen3_without_thinking_is_all_content(smollm2_tokenizer):
    message = {"role": "assistant", "content": "It is sunny."}
    prompt = render(smollm2_tokenizer, "qwen3", [USER], True, enable_thinking=False)
    assert REASONING_PARSERS["qwen3"].prompt_phase(prompt) is False
    reading = ChatReading(None, REASONING_PARSERS["qwen3"], prompt)
    assert read(reading, message["content"], [3, 7])[:2] == ("It is sunny.", "")
    # with thinking on, an output that does not open a block is content too
    open_prompt = render(smollm2_tokenizer, "qwen3", [USER], True)
    assert REASONING_PARSERS["qwen3"].prompt_phase(open_prompt) is None
    assert read(ChatReading(None, REASONING_PARSERS["qwen3"], open_prompt), "  <thin", [3])[:2] == ("  <thin", "")


@settings(max_examples=60, deadline=None)
@given(cuts=cut_points)
def test_deepseek_r1_thinks_until_the_close(smollm2_tokenizer, cuts):
    prompt = render(smollm2_tokenizer, "deepseek_r1", [USER], True)
    parser = REASONING_PARSERS["deepseek_r1"]
    assert parser.prompt_phase(prompt) is True
    output = "Paris is in France.\nCheck the forecast.\n</think>\n\nSunny, 21 °C."
    content, reasoning, _ = read(ChatReading(None, parser, prompt), output, cuts)
    assert (reasoning, content) == ("Paris is in France.\nCheck the forecast.\n", "\n\nSunny, 21 °C.")
    # an older distill whose template does not open the block: thinking all the same, its own <think> dropped
    assert read(ChatReading(None, parser, "<｜Assistant｜>"), "<think>a</think>b", cuts)[:2] == ("b", "a")
    assert read(ChatReading(None, parser, "<｜Assistant｜>"), "a</think>b", cuts)[:2] == ("b", "a")
    assert read(ChatReading(None, parser, prompt), "cut short by max_tokens", cuts)[:2] == \
        ("", "cut short by max_tokens")


@settings(max_examples=60, deadline=None)
@given(cuts=cut_points)
def test_tool_calls_are_read_after_the_thinking(smollm2_tokenizer, cuts):
    message = {"role": "assistant", "reasoning_content": 'Maybe <tool_call>{"name": "get_time"}</tool_call>?',
               "content": "", "tool_calls": CALLS}
    prompt, output = assistant_turn(smollm2_tokenizer, "qwen3", message, "<|im_end|>\n")
    reading = ChatReading(auto("hermes"), REASONING_PARSERS["qwen3"], prompt)
    content, reasoning, calls = read(reading, output, cuts)
    assert reasoning.strip() == message["reasoning_content"] and calls == EXPECTED_CALLS and not content.strip()


@settings(max_examples=60, deadline=None)
@given(cuts=cut_points)
def test_gpt_oss_harmony_channels_and_calls(smollm2_tokenizer, cuts):
    parser = REASONING_PARSERS["gpt_oss"]
    answer = {"role": "assistant", "thinking": "Need weather. Use <b>.", "content": "Sunny."}
    prompt, output = assistant_turn(smollm2_tokenizer, "gpt_oss", answer, "<|end|>", reasoning_effort="low")
    assert "Reasoning: low" in prompt
    assert read(ChatReading(None, parser, prompt), output, cuts)[:2] == ("Sunny.", "Need weather. Use <b>.")
    calling = {"role": "assistant", "thinking": "Call both.", "tool_calls": CALLS}
    prompt, output = assistant_turn(smollm2_tokenizer, "gpt_oss", calling, "<|call|>")
    content, reasoning, calls = read(ChatReading(auto("openai"), parser, prompt), output, cuts)
    assert (content, reasoning, calls) == ("", "Call both.", EXPECTED_CALLS)
    plain = read(ChatReading(None, parser, prompt), "no harmony here", cuts)
    assert plain[:2] == ("no harmony here", "")


def test_the_engine_markers_are_the_parsers_text(smollm2_tokenizer):
    for parser in REASONING_PARSERS.values():
        params = parser.thinking_params(smollm2_tokenizer, max_tokens=4, deadline_ms=None)
        assert smollm2_tokenizer.decode(params.start_ids) == parser.start
        assert smollm2_tokenizer.decode(params.end_ids) == parser.end
        assert params.max_tokens == 4


# ---- tool parsers ------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(cuts=cut_points)
def test_qwen3_coder_xml_calls_typed_by_the_schema(smollm2_tokenizer, cuts):
    message = {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS}
    prompt, output = assistant_turn(smollm2_tokenizer, "qwen3_coder", message, "<|im_end|>\n")
    content, _, calls = read(ChatReading(auto("qwen3_coder"), None, prompt), output, cuts)
    assert content.strip() == "Let me look." and calls == EXPECTED_CALLS
    assert '"days": 3' in json.dumps(calls[0]["arguments"])  # an integer parameter, not "3"


@pytest.mark.parametrize("v3", [False, True])
@settings(max_examples=40, deadline=None)
@given(cuts=cut_points)
def test_mistral_calls_in_both_formats(smollm2_tokenizer, v3, cuts):
    message = {"role": "assistant", "content": "", "tool_calls": CALLS}
    tokenizer = smollm2_tokenizer
    prompt, output = assistant_turn(tokenizer, "mistral", message, tokenizer.eos_token, v3=v3)
    content, _, calls = read(ChatReading(auto("mistral"), None, prompt), output, cuts)
    assert content == "" and calls == EXPECTED_CALLS
    whole = ChatReading(auto("mistral"), None, prompt).whole(output)[2]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in whole)  # what Mistral's templates take back
    assert read(ChatReading(auto("mistral"), None, prompt), "Sunny. [TOOL_CALLS]oops[ARGS]{", cuts)[:2] == \
        ("Sunny. [TOOL_CALLS]oops[ARGS]{", "")


@settings(max_examples=60, deadline=None)
@given(cuts=cut_points)
def test_pythonic_calls(smollm2_tokenizer, cuts):
    message = {"role": "assistant", "content": "", "tool_calls": CALLS}
    prompt, output = assistant_turn(smollm2_tokenizer, "pythonic", message, "<|eot_id|>")
    content, _, calls = read(ChatReading(auto("pythonic"), None, prompt), output, cuts)
    assert content == "" and calls == EXPECTED_CALLS
    for text in ("[not a call]", "[f(x=open('/etc'))]", "The answer is [1, 2].", "[f(x=1)"):
        assert read(ChatReading(auto("pythonic"), None, prompt), text, cuts)[:2] == (text, "")
    trailing = read(ChatReading(auto("pythonic"), None, prompt), "[get_time(zone='a]')] then text", cuts)
    assert trailing == (" then text", "", [{"name": "get_time", "arguments": {"zone": "a]"}}])
    tagged = read(ChatReading(auto("pythonic"), None, prompt), '<|python_start|>[get_time(zone="UTC")]<|python_end|>',
                  cuts)
    assert tagged[2] == [{"name": "get_time", "arguments": {"zone": "UTC"}}]
