"""Tiny random-weight models of every supported family: greedy tokens equal transformers', batched and paged."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends import cpu as cpu_backend
from engine.backends.cuda import TritonAttention
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
    assert llm.engine.backend.name == backend
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind, backend", [
    ("llama-gqa-tied", "cpu"), ("qwen3-qknorm", "cpu"), ("qwen2-bias", "torch"), ("qwen3-qknorm", "triton"),
])
def test_bfloat16_kv_cache_matches_transformers_with_rounded_kv(kind, backend, tiny_model):
    """With ``kv_cache_dtype="bfloat16"`` the pool holds K/V in half the bytes (twice the blocks in the same budget)
    and every attention reads them as stored: greedy tokens equal transformers' with each K/V value rounded to
    bfloat16 on its way into the cache, with chunked prefill, multi-block tables and the C decoder's mixed steps."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model(kind)
    rng = random.Random(5)
    # The interpreter is slow, and its time grows with the programs a launch runs (one per sequence and head): on
    # Triton two prompts, the shortest and the one that spans chunks and blocks, and fewer tokens.
    max_new, lengths = (8, (1, 40)) if backend == "triton" else (24, (1, 5, 17, 40))
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, max_new, kv_dtype=torch.bfloat16) for p in prompts]
    engines = {dtype: LLM(str(folder), block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
                          attention_backend=backend, kv_cache_dtype=dtype) for dtype in ("auto", "bfloat16")}
    llm = engines["bfloat16"]
    assert llm.engine.kv_cache.layers[0][0].dtype == torch.bfloat16
    assert llm.engine.kv_cache.num_blocks == 2 * engines["auto"].engine.kv_cache.num_blocks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new))
    assert [o.outputs[0].token_ids for o in outs] == expected
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind, backend, max_new", [
    ("llama-gqa-tied", "cpu", 30), ("qwen3-qknorm", "cpu", 30), ("llama-gqa-tied", "torch", 30),
    ("qwen3-qknorm", "torch", 30), ("qwen3-qknorm", "triton", 10),  # fewer tokens: the interpreter is slow
])
def test_ngram_speculation_matches_transformers(kind, backend, max_new, tiny_model):
    """Verify steps (the last token plus its drafts as one query chunk) give transformers' greedy tokens on both
    attention paths, with 2-token blocks so drafts cross block boundaries, beside chunked prefills."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model(kind)
    rng = random.Random(1)
    loop = [rng.randrange(3, 512) for _ in range(5)]
    prompts = [loop * 6, [rng.randrange(3, 512) for _ in range(9)], loop * 2 + [7, 8], [5, 5, 5, 5]]
    if backend == "triton":  # the interpreter's time grows with the sequences: the chunked one and a short one
        prompts = [prompts[0], prompts[3]]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, max_new) for p in prompts]
    llm = LLM(str(folder), block_size=2, kv_cache_memory=4 << 20, attention_backend=backend, max_num_batched_tokens=16,
              speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": None})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    llm.engine.block_manager.check_integrity()


def _with_and_without_cpu_decoder(folder, **engine_args) -> tuple[list[LLM], list[int]]:
    """Two engines on ``folder``, the C decoder on, then off, and the query lengths the decoder is given."""
    llms, query_lens = [], []
    for use_decoder in (True, False):
        llm = LLM(str(folder), block_size=4, kv_cache_memory=4 << 20, attention_backend="cpu", gemm_kernels="c",
                  **{"max_num_batched_tokens": 256, **engine_args})  # a budget given: no start-up timing
        backend = llm.engine.backend
        decoder = backend.decoder
        assert decoder is not None

        def counted(x, positions, *args, decoder=decoder):
            query_lens.append(x.shape[0])
            return decoder(x, positions, *args)

        backend.decoder = counted if use_decoder else None
        llms.append(llm)
    return llms, query_lens


def _tokens_and_logprobs(llm: LLM, prompts, params) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


def _generate_with_and_without_cpu_decoder(folder, prompts, params, **engine_args):
    """(token ids, logprobs) per prompt with the C decoder on, then off, and the query lengths it was given."""
    llms, query_lens = _with_and_without_cpu_decoder(folder, **engine_args)
    return [_tokens_and_logprobs(llm, prompts, params) for llm in llms], query_lens


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_cpu_decode_step_is_bit_identical_to_the_module_path(kind, tiny_model, monkeypatch):
    """Decode steps run every layer in one C call (``model.cpu_decoder``); with it switched off, the same requests
    through the per-module path give the very same logprobs, bit for bit. The prompts (over 64 tokens, with the
    context limit for long chunks at 0) are prefilled by the modules in both runs."""
    monkeypatch.setattr(cpu_backend, "DECODER_MAX_PREFILL_CONTEXT", 0)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (65, 70, 100)]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=4)
    (fast, slow), query_lens = _generate_with_and_without_cpu_decoder(tiny_model(kind), prompts, params)
    assert fast == slow
    assert max(query_lens) == len(prompts), "decode steps of the whole batch went through the decoder"


@pytest.mark.parametrize("kind", ["llama-gqa-tied", "qwen3-qknorm"])
def test_cpu_decoder_prefill_chunks_match_the_module_path(kind, tiny_model):
    """Short prefill chunks beside decodes also take the one C call (each prompt token a paged-attention query
    over its prefix); tokens equal and logprobs agree with the modules' flash attention to rounding."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=4)
    (fast, slow), query_lens = _generate_with_and_without_cpu_decoder(
        tiny_model(kind), prompts, params, max_num_batched_tokens=16)
    assert 16 in query_lens, "mixed steps (decodes + prefill chunks) went through the decoder"
    _assert_same_tokens_close_logprobs(fast, slow)


@pytest.mark.parametrize("kind", ["llama-gqa-tied", "qwen3-qknorm"])
def test_cpu_decoder_takes_long_chunks_within_the_context_limit(kind, tiny_model, monkeypatch):
    """Prefill chunks over 64 tokens take the C decoder while their context stays within
    ``CPU_DECODER_MAX_PREFILL_CONTEXT`` (80 here), the modules past it; either way tokens equal the modules' and
    logprobs agree to rounding."""
    monkeypatch.setattr(cpu_backend, "DECODER_MAX_PREFILL_CONTEXT", 80)
    rng = random.Random(4)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=4)
    llms, query_lens = _with_and_without_cpu_decoder(tiny_model(kind))  # one pair for the three prompts
    for n, through_decoder in ((70, True), (80, True), (81, False)):
        prompt = [rng.randrange(3, 512) for _ in range(n)]
        query_lens.clear()
        fast, slow = (_tokens_and_logprobs(llm, [prompt], params) for llm in llms)
        assert (n in query_lens) is through_decoder
        assert query_lens.count(1) == 7, "the decodes took the decoder either way"
        _assert_same_tokens_close_logprobs(fast, slow)


def _assert_same_tokens_close_logprobs(fast, slow):
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(fast, slow, strict=True):
        assert ids == ref_ids
        for position, ref in zip(logprobs, ref_logprobs, strict=True):
            assert position.keys() == ref.keys()
            assert all(abs(position[t].logprob - ref[t].logprob) < 1e-4 for t in ref)


def _triton_case(folder, seed: int) -> tuple[LLM, list[list[int]], list[list[int]]]:
    """An engine on the Triton backend with a 16-token budget, three prompts (1, 9 and 23 tokens) and
    transformers' 12 greedy tokens for each."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 23)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(folder), attention_backend="triton", max_num_batched_tokens=16, kv_cache_memory=4 << 20)
    return llm, prompts, expected


def test_triton_backend_greedy_matches_transformers(tiny_model):
    """The engine with the Triton kernels (interpreted on CPU) gives transformers' greedy tokens too. (Qwen3's
    q/k norms on these kernels: the bfloat16 K/V and speculation tests above; each interpreted case costs 12-28 s of
    the suite on the slow machines.)"""
    llm, prompts, expected = _triton_case(tiny_model("llama-gqa-tied"), seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert isinstance(llm.engine.model.layers[0].self_attn.attn, TritonAttention)


def test_cuda_graph_steps_match_transformers(tiny_model, monkeypatch):
    """The graph path (static buffers, padding to a bucket, a decode query per token), run eagerly here where there
    is no GPU to capture on, gives transformers' greedy tokens beside steps that do not fit and run the usual way.
    Qwen3 here: its q/k norms run inside the captured layers."""
    from engine.backends import cuda_graphs

    llm, prompts, expected = _triton_case(tiny_model("qwen3-qknorm"), seed=2)
    engine = llm.engine
    assert engine.backend.graphs is None  # nothing to capture on a CPU
    # Buckets 1, 2, 4, 8, 12: the 16-token steps do not fit, nor do prompt chunks past 20 positions.
    graphs = cuda_graphs.CudaGraphs(engine.model, engine.kv_cache, 12, 8, engine.max_model_len, engine.device)
    monkeypatch.setattr(cuda_graphs, "MAX_PREFILL_CONTEXT", 20)
    fits, decide = [], graphs.fits
    monkeypatch.setattr(graphs, "fits", lambda meta: fits.append(decide(meta)) or fits[-1])
    engine.backend.graphs = graphs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert graphs.sizes == [1, 2, 4, 8, 12]
    assert graphs.num_replays == sum(fits) > 0 and not all(fits)


def test_cuda_graph_buckets():
    from engine.backends.cuda_graphs import bucket_sizes

    assert bucket_sizes(512)[:13] == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160]
    assert bucket_sizes(512)[-3:] == [384, 448, 512]
    assert bucket_sizes(100)[-2:] == [96, 100] and bucket_sizes(1) == [1]
