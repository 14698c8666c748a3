"""Tiny random-weight models of every supported family: greedy tokens equal transformers', batched and paged."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import TritonAttention
from tests.conftest import TINY_CONFIGS, hf_greedy


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_tiny_model_greedy_matches_transformers(kind, backend, tiny_model):
    from transformers import AutoModelForCausalLM

    folder = tiny_model(kind)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 3, 4, 5, 17, 40)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 24) for p in prompts]

    # block_size 4 and a 16-token budget: multi-block tables and chunked prefill for the longer prompts.
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              attention_backend=backend)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.attention_backend == backend
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_cpu_decode_step_is_bit_identical_to_the_module_path(kind, tiny_model):
    """Decode-only steps run every layer in one C call (``model.cpu_decoder``); with it switched off, the same
    requests through the per-module path give the very same logprobs, bit for bit."""
    folder = tiny_model(kind)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 7, 30)]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=4)
    results, batch_sizes = [], []
    for use_decoder in (True, False):
        llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
                  attention_backend="cpu")
        model = llm.engine.model
        decoder = model.cpu_decoder
        assert decoder is not None

        def counted(x, *args, decoder=decoder):
            batch_sizes.append(x.shape[0])
            return decoder(x, *args)

        model.cpu_decoder = counted if use_decoder else None
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
    assert max(batch_sizes) == len(prompts), "decode steps of the whole batch went through the decoder"


@pytest.mark.parametrize("kind", ["llama-gqa-tied", "qwen3-qknorm"])
def test_triton_backend_greedy_matches_transformers(kind, tiny_model):
    """The engine with the Triton kernels (interpreted on CPU) gives transformers' greedy tokens too."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model(kind)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 23)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(folder), attention_backend="triton", max_num_batched_tokens=16, kv_cache_memory=4 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert isinstance(llm.engine.model.layers[0].self_attn.attn, TritonAttention)
