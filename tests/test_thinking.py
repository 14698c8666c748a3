"""Bounded thinking in the engine: the phases a prompt and the output put a request in, a token budget kept to the
token, a deadline kept by the step time, the answer that follows a forced close, and a grammar that holds only
the answer (engine/thinking.py)."""

import time

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams, ThinkingParams
from engine.thinking import DELIVERY_S, RECENT_S, Phase, StepTimes, ThinkingState

START, END = 300, 301  # the tiny models' vocabulary is 512 tokens: any two serve as markers
PROMPT = [1, 17, 45, 99, 250, 7]


def test_the_prompt_and_the_output_set_the_phase():
    one = ThinkingParams((START,), (END,))
    assert ThinkingState(one, [5, START, 6], 0.0).phase is Phase.THINKING  # the template opened it
    assert ThinkingState(one, [5, START, END, 6], 0.0).phase is Phase.ANSWER  # thinking switched off
    assert ThinkingState(one, [START, END, 5, START], 0.0).phase is Phase.THINKING  # the last block counts
    maybe = ThinkingState(one, [5], 0.0)
    assert maybe.phase is Phase.MAYBE and maybe.start_continuation() == START
    assert not maybe.accept(START) and maybe.phase is Phase.THINKING
    assert not maybe.accept(9) and maybe.num_thinking_tokens == 1
    assert not maybe.accept(END) and maybe.phase is Phase.ANSWER and maybe.num_thinking_tokens == 1
    assert maybe.accept(START) and maybe.phase is Phase.ANSWER  # only the first block is followed
    direct = ThinkingState(one, [5], 0.0)
    assert direct.accept(9) and direct.phase is Phase.ANSWER  # the model answered without thinking


def test_multi_token_markers_count_and_force_from_where_the_model_is():
    params = ThinkingParams((3, 4), (7, 8, 9), max_tokens=2)
    state = ThinkingState(params, [1, 3, 4], 0.0)
    for token in (20, 7):  # a thinking token, then the model begins the end marker itself
        state.accept(token)
    assert state.forced_token(0.0, 0.01) is None  # one thinking token and the marker's first: under budget
    state.accept(21)  # not the marker after all: 20, 7, 21 are thinking
    assert state.num_thinking_tokens == 3
    assert state.forced_token(0.0, 0.01) == 7
    state.accept(7)
    assert state.forced_token(0.0, 0.01) == 8
    state.accept(8)
    assert state.forced_token(0.0, 0.01) == 9
    state.accept(9)
    assert state.phase is Phase.ANSWER and state.num_thinking_tokens == 3 and state.needs_answer
    assert state.forced_token(0.0, 0.01) is None


def test_a_deadline_forces_the_close_when_the_steps_left_reach_it():
    state = ThinkingState(ThinkingParams((START,), (END,), deadline_ms=1000), [START], arrival_time=100.0)
    # the marker, the answer's first token and a step of margin (0.6 s), and the trip to the client (DELIVERY_S)
    assert state.forced_token(now=100.4 - DELIVERY_S - 0.01, step_s=0.2) is None
    assert state.forced_token(now=100.4 - DELIVERY_S + 0.01, step_s=0.2) == END
    times = StepTimes()
    for now, s in ((10.0, 0.01), (10.5, 0.3), (11.0, 0.02)):
        times.observe(s, now)
    assert times.step_s == 0.3  # the slowest recent period
    times.observe(0.02, 10.5 + RECENT_S + 0.1)
    assert times.step_s == 0.02  # out of the window


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama-gqa-tied")), max_model_len=256, enforce_eager=True, gemm_kernels="c")


def thinking_tokens(ids: list[int]) -> list[int]:
    return ids[: ids.index(END)] if END in ids else ids


@pytest.mark.parametrize("budget", [0, 1, 5, 12])
def test_a_token_budget_gives_exactly_that_many_thinking_tokens(llm, budget):
    free = llm.generate([PROMPT + [START]], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].token_ids
    assert END not in free[:13]  # the model would think on: the budget is what stops it
    params = SamplingParams(temperature=0, max_tokens=40, thinking=ThinkingParams((START,), (END,), max_tokens=budget))
    out = llm.generate([PROMPT + [START]], params)[0].outputs[0].token_ids
    assert out[budget] == END
    assert out[:budget] == free[:budget]  # the thinking is the model's own up to the bound
    assert len(out) > budget + 1  # and an answer follows


def test_the_budget_counts_from_a_block_the_model_opens(llm):
    params = SamplingParams(temperature=0, max_tokens=30, logit_bias={START: 100.0},  # opens at once
                            thinking=ThinkingParams((START,), (END,), max_tokens=4))
    out = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert out[0] == START and out[5] == END


def test_a_forced_close_is_followed_by_an_answer(llm):
    eos = 2
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 50.0},  # the model wants to stop at once
                            thinking=ThinkingParams((START,), (END,), max_tokens=0))
    out = llm.generate([PROMPT + [START]], params)[0].outputs[0].token_ids
    assert out[0] == END and out[1] != eos and out[2] == eos


def test_the_budget_holds_in_a_batch_with_others(llm):
    budgets = [None, 3, 7]
    params = [SamplingParams(temperature=0, max_tokens=20, thinking=ThinkingParams((START,), (END,), max_tokens=b))
              for b in budgets]
    outs = llm.generate([PROMPT + [START]] * 3, params)
    alone = llm.generate([PROMPT + [START]], params[2])[0].outputs[0].token_ids
    assert END not in outs[0].outputs[0].token_ids[:8]
    assert outs[1].outputs[0].token_ids[3] == END and outs[2].outputs[0].token_ids[7] == END
    assert outs[2].outputs[0].token_ids == alone


def test_a_deadline_closes_thinking_in_time(llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                            thinking=ThinkingParams((START,), (END,), deadline_ms=300))
    engine = llm.engine
    start = time.monotonic()
    engine.add_request("deadline", PROMPT + [START], params, arrival_time=start)
    closed_at = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if END in output.new_token_ids and closed_at is None:
                closed_at = time.monotonic()
    assert closed_at is not None and closed_at - start < 0.3


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_model_len=512, gemm_kernels="c")


def test_a_grammar_holds_the_answer_only(default_llm):
    grammar = StructuredOutputsParams(choice=("yes", "no"))
    text = default_llm.tokenizer.decode
    prompt = default_llm.tokenizer.encode("Is the sky blue? Answer yes or no.")

    def run(prompt: list[int], **options: object) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=grammar,
                                thinking=ThinkingParams((START,), (END,), max_tokens=6), **options)
        return default_llm.generate([prompt], params)[0].outputs[0].token_ids

    out = run(prompt + [START])  # thinking opened by the prompt: free text, then the grammar
    assert out[6] == END and text(out[7:], skip_special_tokens=True) in ("yes", "no")
    opened = run(prompt, logit_bias={START: 100.0})  # before the model opens a block, it may
    assert opened[0] == START and opened[7] == END and text(opened[8:], skip_special_tokens=True) in ("yes", "no")
    direct = run(prompt)  # or answer at once, inside the grammar
    assert START not in direct and text(direct, skip_special_tokens=True) in ("yes", "no")
