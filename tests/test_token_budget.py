"""The CPU's step token budget, sized at start-up from timed prefill steps."""

import pytest

from engine import LLM, SamplingParams
from engine.start_up import (
    MAX_CPU_TOKEN_BUDGET,
    MIN_CPU_TOKEN_BUDGET,
    SHORT_PROBE_TOKENS,
    burst_room,
    cpu_token_budget,
    fixed_tokens,
    long_probe_tokens,
    probe_room,
    size_cpu_token_budget,
    warm_up_bursts,
)


@pytest.mark.parametrize(("per_token_ms", "budget"),
                         [(1.55, 384), (1.58, 368), (2.41, 240), (4.0, 144), (9.0, 128), (0.1, 1024)])
def test_budget_fills_the_target_step_time(per_token_ms, budget):
    assert cpu_token_budget(per_token_ms / 1000) == budget


@pytest.mark.parametrize(("short_ms", "most", "tokens"),
                         [(8.7, 256, 80), (7.0, 256, 96), (2.3, 256, 256), (14.0, 256, 64), (1.0, 199, 199)])
def test_long_probes_are_about_one_target_step_at_the_short_probes_rate(short_ms, most, tokens):
    """A 1B (8.7 ms a token in an 8-token step) probes with 80 tokens, not 256; the default model (2.3 ms) still
    with 256; never under half the smallest budget, never over what the pool and context hold."""
    assert long_probe_tokens(short_ms / 1000, most) == tokens


@pytest.mark.parametrize(("one_ms", "many_ms", "n", "fixed"),
                         [(8.25, 72.0, 256, 32.0), (1.0, 32.0, 32, 0.0), (2.0, 1.5, 32, 0.0), (3.0, 3.0, 32, 0.0)])
def test_a_steps_fixed_cost_from_two_step_times(one_ms, many_ms, n, fixed):
    """t(n) = a + b n through a 1-token and an n-token step: a / b, never negative (a step that takes no longer for
    more tokens shows no per-token cost to weigh it in, so 0)."""
    assert fixed_tokens(one_ms / 1000, many_ms / 1000, n) == pytest.approx(fixed)


def test_engine_sizes_its_budget_and_leaves_no_trace(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa-tied")), kv_cache_memory=4 << 20, attention_backend="cpu")
    engine = llm.engine
    budget = engine.max_num_batched_tokens
    assert MIN_CPU_TOKEN_BUDGET <= budget <= MAX_CPU_TOKEN_BUDGET and budget % 16 == 0
    assert engine.scheduler.max_num_batched_tokens == budget
    assert engine.scheduler.step_fixed_tokens >= 0
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0


def test_an_explicit_budget_or_a_toy_pool_is_kept(tiny_model):
    folder = str(tiny_model("llama-gqa-tied"))
    assert LLM(folder, kv_cache_memory=4 << 20, max_num_batched_tokens=48).engine.max_num_batched_tokens == 48
    # 4 blocks of 16 tokens: too small to time a prefill step in, so the default stays.
    toy = LLM(folder, kv_cache_memory=4 * 2 * 2 * 2 * 16 * 16 * 4, attention_backend="cpu")
    assert toy.engine.kv_cache.num_blocks == 4
    assert toy.engine.max_num_batched_tokens == 256
    assert toy.engine.scheduler.step_fixed_tokens == 0  # nor is a fixed cost weighed into the prompt cap


def test_warm_up_serves_bursts_down_to_the_graphs_and_leaves_no_trace(tiny_model):
    """The GPU's start-up warm-up, run here on the CPU: bursts of the whole budget, then half of it, down to the
    largest step a graph would take (none here: 128-token prompts), each a prefill step of its size; then a wave
    whose first three prompts come a step early and decode beside the others."""
    llm = LLM(str(tiny_model("llama-gqa-tied")), kv_cache_memory=4 << 20, max_num_batched_tokens=512)
    engine = llm.engine
    runner_execute, steps = engine.model_runner.execute, []

    def spy(sched):
        steps.append((sched.total_num_scheduled_tokens, len(sched.scheduled_requests)))
        return runner_execute(sched)

    engine.model_runner.execute = spy
    most, length = burst_room(engine.config.max_num_seqs, engine.kv_cache.num_blocks, 16, engine.max_model_len)
    warm_up_bursts(engine.serve_made_up_prompts, engine.max_num_batched_tokens, most, length, smallest=128)
    assert steps[:3] == [(512, 4), (256, 2), (3 * 128, 3)]  # the bursts, then the first wave's early three
    num_tokens, num_reqs = steps[3]
    assert num_reqs == 4 and num_tokens > 3  # their decodes beside the rest's prompt tokens
    assert sum(t for t, _ in steps[3:]) == 3 + 4 * 128
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids


@pytest.mark.parametrize(("ms_per_token", "long_probes"),
                         [(200.0, False), (20.0, False), (10.0, True), (5.0, True), (1.5, True)])
def test_only_a_model_too_slow_for_more_than_the_smallest_budget_skips_the_long_probes(tiny_model, ms_per_token,
                                                                                        long_probes):
    """A short step slower per token than SHORT_PROBE_MARGIN x the smallest budget's share of the target step (an 8B
    model on 2 cores: ~150 ms) settles the budget at the smallest; a faster one (the default model: ~2.4 ms at 8
    tokens) is timed with long steps. Step times are made up here: t(n) = n x ms_per_token."""
    llm = LLM(str(tiny_model("llama-gqa-tied")), kv_cache_memory=4 << 20, max_num_batched_tokens=128)
    engine, lengths = llm.engine, []

    def timed(key: int, num_prompts: int, length: int, **_: object) -> float:
        lengths.append(length)
        return length * ms_per_token / 1000

    room = probe_room(engine.max_model_len, engine.kv_cache.num_blocks, engine.config.block_size)
    budget = size_cpu_token_budget(timed, room, engine.config.block_size)
    assert lengths[:2] == [1, SHORT_PROBE_TOKENS]
    assert (max(lengths) > SHORT_PROBE_TOKENS) == long_probes
    if long_probes:
        assert max(lengths) == long_probe_tokens(ms_per_token / 1000, room)
    assert budget.max_num_batched_tokens == cpu_token_budget(ms_per_token / 1000)
    if not long_probes:
        assert budget.max_num_batched_tokens == MIN_CPU_TOKEN_BUDGET and budget.step_fixed_tokens == 0
