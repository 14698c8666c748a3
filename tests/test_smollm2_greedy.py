"""SmolLM2-135M-Instruct (the default model): our greedy tokens equal transformers' greedy generate, whatever else
is in the batch, with requests joining mid-flight, under preemption and under chunked prefill."""

import pytest
import torch

from engine.backends import amx_blocks, cpu_bodies
from engine.backends.greedy_head import Int8ScreenedHead
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels import cpu
from tests.conftest import greedy_agreement, hf_greedy, quick

MAX_NEW = 40
BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2: layers x kv_heads x head_dim, fp32, 16-token blocks


@pytest.fixture(scope="module")
def expected(hf_smollm2, prompt_ids):
    return [hf_greedy(hf_smollm2, ids, MAX_NEW) for ids in prompt_ids]


def run_staggered(engine: EngineCore, prompt_ids: list[list[int]], arrival_steps: list[int]) -> dict[str, list[int]]:
    """Add request i at step arrival_steps[i]; check the pool's bookkeeping after every step."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_ids))}
    step = 0
    while step <= max(arrival_steps) or engine.has_unfinished_requests():
        for i, arrival in enumerate(arrival_steps):
            if arrival == step:
                engine.add_request(str(i), prompt_ids[i], params)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.block_manager.check_integrity()
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens


def engine_with(**options) -> EngineCore:
    """The default model on the C panels (their formats are checked below), whatever the start-up plan would take,
    with the exact products (``--quantized-matmul exact``) whose tokens equal transformers'."""
    return EngineCore(EngineConfig(model=None, gemm_kernels="c", **quick(**options)))


ARRIVALS = [0, 0, 1, 3, 3, 7, 12, 20]  # later requests join while earlier ones are decoding


@pytest.mark.parametrize("on_tiles", [True, False], ids=["q4-on-amx", "q4-on-fmas"])
def test_greedy_identical_with_staggered_arrivals(prompt_ids, expected, monkeypatch, on_tiles):
    """Where the CPU has AMX tiles, both bodies of the Q4_1 projections in fp32 (tiles, Q4S panels, or the FMAs, Q4
    panels; start-up's timing overruled): each gives transformers' tokens, whatever else is in the batch."""
    if on_tiles and "amx" not in cpu.bf16_dots():
        pytest.skip("the CPU has no AMX tiles")
    monkeypatch.setattr(amx_blocks, "faster", lambda _: on_tiles)
    engine = engine_with()
    layer = engine.model.layers[0]
    if engine.backend.name == "cpu":  # the GGUF's Q4_1 projections and Q8_0 head (test_compact_weights.py)
        panels = torch.float8_e5m2fnuz if on_tiles else torch.uint8  # Q4S or Q4 panels (test_split_tiles.py)
        assert layer.mlp.down_proj.kernel.packed.dtype == layer.self_attn.qkv_proj.kernel.packed.dtype == panels
        assert engine.model.lm_head.kernel.packed.dtype == torch.int8
        # the exact head's int8 screen where start-up timed it faster (test_greedy_tokens_from_the_int8_screen)
        assert engine.backend.greedy_head is None or isinstance(engine.backend.greedy_head, Int8ScreenedHead)
    tokens = run_staggered(engine, prompt_ids, ARRIVALS)
    assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.skipif(not cpu.q8x_available(), reason="no integer dot products on this CPU")
def test_greedy_tokens_from_the_int8_screen(prompt_ids, expected, monkeypatch):
    """The Q8_0 head's int8 screen, taken here whatever start-up timing would choose: plain greedy steps of every
    batch size never compute the full logits, and the tokens are transformers' (the exact head's)."""
    monkeypatch.setattr(cpu_bodies, "screen_row_range", lambda screen: ((1, 64), {}))
    engine = engine_with()
    screen = engine.backend.greedy_head
    assert isinstance(screen, Int8ScreenedHead) and (screen.min_rows, screen.max_rows) == (1, 64)
    calls, decided = [], []
    compute_logits, argmax = engine.model.compute_logits, screen.argmax
    engine.model.compute_logits = lambda hidden: calls.append(hidden.shape[0]) or compute_logits(hidden)
    screen.argmax = lambda hidden: decided.append(hidden.shape[0]) or argmax(hidden)
    tokens = run_staggered(engine, prompt_ids, ARRIVALS)
    assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected
    assert calls == [] and max(decided) >= 4  # every step's tokens from the screen, batches of several rows too


@pytest.mark.skipif(not cpu.q8x_available(), reason="no integer dot products on this CPU")
def test_the_int8_screen_is_timed_again_once_started(monkeypatch):
    """A server's engine (``own_process``) times the screen again once the API process has loaded, and keeps that
    choice: a screen timed slower at first is taken up, and one timed faster dropped."""
    for first, again in (((0, 0), (4, 256)), ((1, 256), (0, 0))):
        timings, seen = iter((first, again)), []

        def timed(screen, timings=timings, seen=seen):
            seen.append(next(timings))
            return seen[-1], {}

        monkeypatch.setattr(cpu_bodies, "screen_row_range", timed)
        engine = EngineCore(EngineConfig(model=None, gemm_kernels="c", **quick()), own_process=True)
        backend = engine.backend
        assert isinstance(backend.int8_screen, Int8ScreenedHead) and seen == [first, again]
        assert backend.greedy_head is (backend.int8_screen if again[1] else None)
        assert (backend.int8_screen.min_rows, backend.int8_screen.max_rows) == again
        assert engine.kernel_plan.chosen("int8 screen rows") == (f"{again[0]}-{again[1]}" if again[1] else "none")


def test_greedy_identical_under_preemption(prompt_ids, expected):
    engine = engine_with(kv_cache_memory=14 * BYTES_PER_BLOCK)
    assert engine.block_manager.num_blocks == 14
    tokens = run_staggered(engine, prompt_ids, [0] * len(prompt_ids))
    assert engine.scheduler.num_preemptions > 0
    assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected


def test_greedy_identical_with_chunked_prefill(prompt_ids, expected):
    engine = engine_with(max_num_batched_tokens=8)
    original_schedule = engine.scheduler.schedule
    chunked = []

    def spy():
        out = original_schedule()
        chunked.extend(
            r.request_id
            for r in out.scheduled_requests
            if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] < r.num_tokens
        )
        assert out.total_num_scheduled_tokens <= 8
        return out

    engine.scheduler.schedule = spy
    tokens = run_staggered(engine, prompt_ids, ARRIVALS)
    assert chunked, "no prompt was prefilled in chunks"
    assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected


@pytest.mark.parametrize("pool_blocks", [None, 14])
def test_greedy_identical_with_ngram_speculation(prompt_ids, expected, pool_blocks):
    """Drafts verified several tokens a step give transformers' tokens, with requests joining mid-flight and,
    with a 14-block pool, under preemption; both accepted and rejected drafts occur."""
    memory = None if pool_blocks is None else pool_blocks * BYTES_PER_BLOCK
    engine = engine_with(kv_cache_memory=memory, speculative_config={"disable_by_batch_size": None})
    tokens = run_staggered(engine, prompt_ids, ARRIVALS if pool_blocks is None else [0] * len(prompt_ids))
    assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert (engine.scheduler.num_preemptions > 0) == (pool_blocks is not None)


@pytest.mark.skipif(not cpu.q8x_available(), reason="needs integer dot products")
def test_the_default_int8_products_agree_with_transformers_until_a_near_tie(hf_smollm2, prompt_ids, expected):
    """A GGUF file's products on a CPU with integer dot products are int8 by default (``--quantized-matmul auto``):
    the activations rounded to int8 per 32 inputs, as llama.cpp multiplies; ``exact`` keeps the bits of the
    dequantized model's products. Measured here on the test prompts (printed; docs/serving.md): where the int8
    tokens first differ from transformers' fp32, each side's token is among the other's top 5 (a near tie, the
    rounding tipping it), and at least half the prompts are identical to the end; before the first divergence their
    logprobs stay within 0.5 of the exact products'. Its tokens do not depend on the batch."""
    llm = LLM(None, **quick(quantized_matmul="auto"))
    assert llm.engine.kernel_plan.chosen("GGUF products") == "int8"
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    outs = llm.generate(prompt_ids, params)
    identical, matched, firsts = greedy_agreement(hf_smollm2, prompt_ids, outs, expected)
    alone = [llm.generate([ids], params)[0].outputs[0].token_ids for ids in prompt_ids[::4]]
    assert [o.outputs[0].token_ids for o in outs][::4] == alone
    del llm
    exact = LLM(None, **quick())
    assert exact.engine.kernel_plan.chosen("GGUF products") == "exact"
    deltas = []
    for ours, theirs in zip(outs, exact.generate(prompt_ids, params), strict=True):
        a, b = ours.outputs[0], theirs.outputs[0]
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                    min(len(a.token_ids), len(b.token_ids)))
        deltas += [abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob) for i, t in enumerate(a.token_ids[:same])]
    print(f"int8 products vs transformers fp32: {identical}/{len(prompt_ids)} identical for {MAX_NEW} tokens, "
          f"{matched / sum(map(len, expected)):.2f} of tokens before the first divergence; first divergence / "
          f"transformers' length: {firsts}; logprob |int8 - exact| before the first divergence: mean "
          f"{sum(deltas) / len(deltas):.4f}, max {max(deltas):.4f} over {len(deltas)} tokens")
    assert identical >= len(prompt_ids) // 2 and max(deltas) < 0.5


@pytest.mark.parametrize("products", ["exact", "int8"])
def test_int8_kv_cache_agrees_with_transformers_until_a_near_tie(hf_smollm2, prompt_ids, expected, products):
    """``--kv-cache-dtype int8`` keeps each K/V row as int8 with its scale (kernels/kv_int8.py): not exact. Measured on
    the test prompts (printed; docs/history/benchmarks-2026-12.md), alone and with int8 products: where its tokens first
    differ from transformers' fp32, each side's token is among the other's top 5, and at least half the prompts are
    identical to the end."""
    if products == "int8" and not cpu.q8x_available():
        pytest.skip("needs integer dot products")
    llm = LLM(None, **quick(kv_cache_dtype="int8", quantized_matmul=products))
    assert llm.engine.kv_cache.layers[0][0].dtype == torch.int8
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5))
    identical, matched, firsts = greedy_agreement(hf_smollm2, prompt_ids, outs, expected)
    print(f"int8 K/V pool, {products} products, vs transformers fp32: {identical}/{len(prompt_ids)} identical for "
          f"{MAX_NEW} tokens, {matched / sum(map(len, expected)):.2f} of tokens before the first divergence; first "
          f"divergence / transformers' length: {firsts}")
    assert identical >= len(prompt_ids) // 2
