"""Tool calls read from generated text: each tool_choice's reader, whole and under every way a stream can cut the
text, and the checks of a request's tools and tool_choice (no model)."""

import copy
import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from server.chat_reader import ChatReading
from server.prompts import render_chat
from server.protocol import ChatMessage
from server.tool_calls import RequiredCallsReader, plan_tools
from server.tool_parsers import HermesCallsReader, Llama3JsonCallsReader

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris; {FR}"}}; '
          '{"name": "get_time", "arguments": {}}')
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" [x]"}}, {"name": "get_time", ' \
           '"parameters": {}}]'


def whole_message(plan, text: str) -> tuple[str | None, list[dict]]:
    content, reasoning, calls = ChatReading(plan, None).whole(text)
    assert reasoning is None
    return content, calls


def streamed(plan, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed ``text`` cut at ``cuts`` to a fresh reader and put the deltas together as a client does."""
    reader = plan.reader()
    bounds = [0, *sorted(set(cuts)), len(text)]
    content, calls = "", {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        delta = reader.feed(text[a:b], final=k == len(bounds) - 2)
        content += delta.content
        for call in delta.tool_calls:
            if call["index"] not in calls:
                assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function"
                calls[call["index"]] = {"id": call["id"], "type": "function", "function": dict(call["function"])}
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in range(len(calls))]


def without_ids(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


cut_points = st.lists(st.integers(min_value=1, max_value=200), max_size=12)


@settings(max_examples=150, deadline=None)
@given(cuts=cut_points)
def test_hermes_calls_read_the_same_whole_and_streamed(cuts):
    plan = plan_tools([WEATHER, TIME], "auto", True, "hermes")
    content, calls = whole_message(plan, HERMES)
    assert content == "Let me check.\n"
    assert without_ids(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert plan.finish_reason("stop", True) == "tool_calls" and plan.finish_reason("length", True) == "length"
    s_content, s_calls = streamed(plan, HERMES, [c for c in cuts if c < len(HERMES)])
    assert (s_content, without_ids(s_calls)) == (content, without_ids(calls))


@pytest.mark.parametrize(("text", "content"), [
    ("no calls at all, not even <tool", "no calls at all, not even <tool"),  # a tag's start, then the end
    ("<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done"),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),  # no name
])
def test_hermes_text_that_is_no_call_stays_content(text, content):
    plan = plan_tools([WEATHER], "auto", True, "hermes")
    assert whole_message(plan, text) == (content, [])
    for cut in range(1, len(text)):
        assert streamed(plan, text, [cut]) == (content, [])


def test_hermes_holds_back_only_what_could_open_a_call():
    reader = HermesCallsReader()
    assert reader.feed("Sure <to", final=False).content == "Sure "
    assert reader.feed("ol", final=False).content == ""
    assert reader.feed("s!", final=False).content == "<tools!"
    unterminated = HermesCallsReader()
    delta = unterminated.feed('<tool_call>{"name": "get_time", "arguments": {}}', final=True)  # cut by max_tokens
    assert delta.content == "" and [c["function"]["name"] for c in delta.tool_calls] == ["get_time"]


@settings(max_examples=150, deadline=None)
@given(cuts=cut_points, tagged=st.booleans())
def test_llama3_json_calls_read_the_same_whole_and_streamed(cuts, tagged):
    plan = plan_tools([WEATHER, TIME], "auto", True, "llama3_json")
    text = LLAMA3 if tagged else " " + LLAMA3.removeprefix("<|python_tag|>")
    content, calls = whole_message(plan, text)
    assert content is None
    assert without_ids(calls) == [("get_weather", '{"city": "Paris; {FR}"}'), ("get_time", "{}")]
    s_content, s_calls = streamed(plan, text, [c for c in cuts if c < len(text)])
    assert (s_content, without_ids(s_calls)) == ("", without_ids(calls))


@pytest.mark.parametrize(("text", "content", "names"), [
    ("The weather is fine.", "The weather is fine.", []),
    ("<|python", "<|python", []),  # cut short inside the tag: what there is, as content
    ("<|python_tag|>", "<|python_tag|>", []),  # the tag, and nothing after it
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call: an answer in JSON
    ('{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),  # cut by max_tokens
    ('{"name": "get_time", "parameters": {}} and then some', "and then some", ["get_time"]),
])
def test_llama3_json_output_that_is_not_all_calls(text, content, names):
    plan = plan_tools([WEATHER, TIME], "auto", True, "llama3_json")
    whole_content, calls = whole_message(plan, text)
    assert (whole_content or "", [c["function"]["name"] for c in calls]) == (content, names)
    for cut in range(1, len(text)):
        s_content, s_calls = streamed(plan, text, [cut])
        assert (s_content, [c["function"]["name"] for c in s_calls]) == (content, names)


def test_llama3_json_decides_on_the_first_characters():
    reader = Llama3JsonCallsReader()
    assert reader.feed(" \n<|py", final=False) == Llama3JsonCallsReader().feed("", final=False)  # undecided
    assert reader.feed("x", final=False).content == " \n<|pyx"  # not the tag: content, from the start
    calls = Llama3JsonCallsReader()
    assert calls.feed('{"name": "get_time", "param', final=False).tool_calls == []  # a call, not yet complete
    assert [c["function"]["name"] for c in calls.feed('eters": {}}', final=False).tool_calls] == ["get_time"]


@settings(max_examples=150, deadline=None)
@given(cuts=cut_points)
def test_required_calls_read_the_same_whole_and_streamed(cuts):
    plan = plan_tools([WEATHER, TIME], "required", True, None)
    content, calls = whole_message(plan, REQUIRED)
    assert content is None
    assert without_ids(calls) == [("get_weather", '{"city": "Paris, \\"FR\\" [x]"}'), ("get_time", "{}")]
    s_content, s_calls = streamed(plan, REQUIRED, [c for c in cuts if c < len(REQUIRED)])
    assert s_content == "" and without_ids(s_calls) == without_ids(calls)


def test_a_required_array_cut_short_is_content():
    cut = REQUIRED[:30]
    plan = plan_tools([WEATHER], "required", True, None)
    assert whole_message(plan, cut) == (cut, [])
    first = REQUIRED[: REQUIRED.index("}}") + 2]  # the first call complete, the second not begun
    assert [c["function"]["name"] for c in RequiredCallsReader().feed(first, final=True).tool_calls] == ["get_weather"]


@settings(max_examples=50, deadline=None)
@given(cuts=cut_points)
def test_a_named_call_streams_its_arguments(cuts):
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True, None)
    text = '{"city": "Paris"}'
    content, calls = whole_message(plan, text)
    assert content is None and without_ids(calls) == [("get_weather", text)]
    s_content, s_calls = streamed(plan, text, [c for c in cuts if c < len(text)])
    assert s_content == "" and without_ids(s_calls) == without_ids(calls)
    assert plan.finish_reason("stop", True) == "stop"


def test_tool_choice_checks():
    with pytest.raises(ValueError, match="distinct"):
        plan_tools([WEATHER, WEATHER], "required", True, None)
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        plan_tools([], "required", True, None)
    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        plan_tools([WEATHER], {"type": "function", "function": {"name": "nope"}}, True, None)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice --tool-call-parser"):
        plan_tools([WEATHER], None, True, None)  # tools given: "auto" is the default
    assert plan_tools([], None, True, None).kind == "none"
    assert plan_tools([WEATHER], "none", True, None).reader() is None
    assert plan_tools([WEATHER], None, True, "hermes").kind == "auto"
    assert isinstance(plan_tools([WEATHER], "auto", True, "llama3_json").reader(), Llama3JsonCallsReader)


def test_required_grammar_accepts_only_calls_of_the_tools(smollm2_tokenizer):
    """The schema of "required", compiled as the engine compiles it: one or more {"name", "parameters"} objects,
    at most one without parallel_tool_calls."""
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer)
    compiler = xgr.GrammarCompiler(info)

    def accepts(plan, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(plan.structured_outputs().json))
        return matcher.accept_string(text) and matcher.is_completed()

    parallel = plan_tools([WEATHER, TIME], "required", True, None)
    single = plan_tools([WEATHER, TIME], "required", False, None)
    one = '[{"name": "get_time", "parameters": {"any": 1}}]'
    assert accepts(parallel, REQUIRED) and accepts(parallel, one) and accepts(single, one)
    assert not accepts(single, REQUIRED) and not accepts(parallel, "[]")
    assert not accepts(parallel, '[{"name": "get_weather", "parameters": {}}]')  # city is required
    assert not accepts(parallel, '[{"name": "get_date", "parameters": {}}]')
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True, None)
    assert json.loads(named.structured_outputs().json) == WEATHER["function"]["parameters"]


TOOL_TEMPLATE = (  # what tool-aware templates read: the tools, an assistant's calls (arguments as an object), ids
    "{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }}]"
    "{% endfor %}{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
)


def test_tools_and_earlier_calls_reach_the_chat_template(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    messages = [ChatMessage(role="user", content="Weather in Paris?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "call-1", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
                ChatMessage(role="tool", tool_call_id="call-1", content="Sunny")]
    prompt = render_chat(tokenizer, messages, add_generation_prompt=False, tools=[WEATHER, TIME])
    assert prompt.text == ("tool get_weather\ntool get_time\nuser: Weather in Paris?\n"
                           "assistant: [call-1 get_weather city=Paris]\ntool: Sunny (answers call-1)\n")
