"""On a CUDA GPU: the engine with its Triton kernels against transformers on the same device and dtype.

Skipped where there is no GPU; there the same kernels run under the Triton interpreter (test_kernels.py,
test_models_tiny.py). In float32 the tokens must be equal. In bfloat16 two correct implementations round
differently and part ways at near-ties, so the check is vLLM's: equal up to the first difference, and there each
side's token is among the other's top candidates.
"""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import TINY_CONFIGS, hf_greedy
from tests.test_smollm2_greedy import ARRIVALS, MAX_NEW, engine_with, run_staggered

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOP_K = 5


def hf_on_gpu(folder, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()


def hf_greedy_with_top_k(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy tokens and, for each position, its TOP_K most likely tokens."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=model.generation_config.eos_token_id)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [set(s[0].topk(TOP_K).indices.tolist()) for s in out.scores]


@pytest.fixture(scope="module")
def hf_float32(smollm2_path):
    return hf_on_gpu(smollm2_path, torch.float32)


@pytest.fixture(scope="module")
def expected_float32(hf_float32, prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_float32, ids, MAX_NEW) for ids in prompt_ids]


def test_float32_greedy_equals_transformers_with_staggered_arrivals(prompt_ids, expected_float32):
    for eager in (False, True):
        engine = engine_with(device="cuda", dtype="float32", enforce_eager=eager)
        assert engine.backend.name == "triton"
        tokens = run_staggered(engine, prompt_ids, ARRIVALS)
        assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected_float32
        graphs = engine.backend.graphs
        assert (graphs is None) if eager else graphs.num_replays > 0


def test_float32_greedy_with_ngram_drafts_equals_transformers(prompt_ids, expected_float32):
    """Verify steps (a request's last token and its drafts) run eagerly between graph-replayed decode steps."""
    engine = engine_with(device="cuda", dtype="float32", speculative_config={"disable_by_batch_size": None})
    tokens = run_staggered(engine, prompt_ids, ARRIVALS)
    assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected_float32
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert engine.backend.graphs.num_replays > 0


def test_bfloat16_kv_cache_equals_transformers_with_rounded_kv(hf_float32, prompt_ids):
    """A float32 model over a bfloat16 pool: the Triton kernels store K/V rounded to bfloat16 and read them back
    into float32 arithmetic, so greedy tokens equal transformers' with every K/V value rounded the same way on its
    way into the cache, graphs and eager alike."""
    expected = [hf_greedy(hf_float32, ids, MAX_NEW, kv_dtype=torch.bfloat16) for ids in prompt_ids]
    for eager in (False, True):
        engine = engine_with(device="cuda", dtype="float32", kv_cache_dtype="bfloat16", enforce_eager=eager)
        assert engine.kv_cache.layers[0][0].dtype == torch.bfloat16
        tokens = run_staggered(engine, prompt_ids, ARRIVALS)
        assert [tokens[str(i)] for i in range(len(prompt_ids))] == expected


def test_bfloat16_greedy_agrees_with_transformers_until_a_near_tie(smollm2_path, prompt_ids):
    hf = hf_on_gpu(smollm2_path, torch.bfloat16)
    llm = LLM(None, device="cuda", dtype="bfloat16")
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=TOP_K))
    identical = 0
    for ids, out in zip(prompt_ids, outs, strict=True):
        ref_tokens, ref_top = hf_greedy_with_top_k(hf, ids, MAX_NEW)
        ours = out.outputs[0]
        first_diff = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref_tokens, strict=False)) if a != b), None)
        if first_diff is None:
            assert len(ours.token_ids) == len(ref_tokens)
            identical += 1
            continue
        our_top = {t for t, lp in ours.logprobs[first_diff].items() if lp.rank <= TOP_K}
        assert ours.token_ids[first_diff] in ref_top[first_diff], (ids, first_diff)
        assert ref_tokens[first_diff] in our_top, (ids, first_diff)
    print(f"bfloat16: {identical} of {len(prompt_ids)} prompts token-identical to transformers for {MAX_NEW} tokens")
    assert identical >= len(prompt_ids) // 2
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_tiny_models_float32_greedy_equals_transformers(kind, eager, tiny_model):
    folder = tiny_model(kind)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 3, 4, 5, 17, 40)]
    hf = hf_on_gpu(folder, torch.float32)
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    # A 16-token budget: multi-block tables and chunked prefill for the longer prompts.
    llm = LLM(str(folder), device="cuda", dtype="float32", max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              enforce_eager=eager)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.backend.name == "triton"


def test_pages_under_16_tokens_are_refused_on_a_gpu(tiny_model):
    with pytest.raises(ValueError, match="block_size and head_dim >= 16"):
        LLM(str(tiny_model("qwen3-qknorm")), device="cuda", block_size=8, kv_cache_memory=4 << 20)


def test_graph_replays_equal_eager_steps_in_bfloat16(tiny_model):
    """A graph replays the very kernels of an eager step over the same padded bucket, so the hidden states of a
    captured step equal those of the same forward run eagerly, bit for bit, for every bucket size."""
    llm = LLM(str(tiny_model("llama-gqa-tied")), device="cuda", dtype="bfloat16", kv_cache_memory=64 << 20)
    graphs, runner = llm.engine.backend.graphs, llm.engine.model_runner
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(40)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))  # fills the pool with K/V to attend
    rng = torch.Generator().manual_seed(0)
    for size in graphs.sizes[:12]:
        graphs.tokens[0, :size] = torch.randint(3, 500, (size,), generator=rng).cuda()
        graphs.tokens[1, :size] = torch.randint(0, 40, (size,), generator=rng).cuda()
        graphs.tokens[2, :size] = -1  # store nothing: both runs must attend the same pool
        graphs.tokens[3, :size] = torch.randint(0, 8, (size,), generator=rng).cuda()
        graphs.block_tables[:8, :4] = torch.randint(0, runner.kv_cache.num_blocks, (8, 4), generator=rng).cuda()
        graphs.graphs[size].replay()
        with torch.inference_mode():
            eager = graphs._forward(size)
        assert torch.equal(graphs.outputs[size], eager), size
