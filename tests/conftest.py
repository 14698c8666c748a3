"""Shared fixtures: the default model's folder, transformers references, and tiny random-weight models."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter when there is no GPU; it must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engine.model_loader import reference_folder  # noqa: E402

# What an engine of the default model starts with in a test (in process, or behind a test server, which passes them
# as flags): a 512 MiB KV pool instead of the default 2 GiB, whose zeroing took up to 3 s of each start, and a fixed
# token budget instead of the start-up probes that size it (~2 s; tests/test_token_budget.py tests those).
# Tests compare tokens with transformers' greedy output, so GGUF products run exact (fp32 activations); the int8
# products the CPU default picks are checked for agreement on their own in test_smollm2_greedy.py.
QUICK_ENGINE = {"kv_cache_memory": 512 << 20, "max_num_batched_tokens": 512, "quantized_matmul": "exact"}


def quick(**options) -> dict:
    """``QUICK_ENGINE``, with ``options`` overriding it."""
    return {**QUICK_ENGINE, **options}


# Prompts of different lengths; the last ones span several 16-token blocks.
PROMPTS = [
    "The capital of France is",
    "Hello",
    "Write a short poem about the sea.",
    "List three prime numbers:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his "
    "three children. Every morning the woodcutter walked into the forest with his axe, and every evening",
    "Question: A train leaves the station at 3 pm travelling at 60 km/h. A second train leaves the same station at "
    "4 pm travelling at 90 km/h on the same track. At what time does the second train catch up with the first? "
    "Answer step by step.",
]


@pytest.fixture(scope="session")
def shared_server():
    """One server of the default model for the modules that ask nothing else of it (a start costs the suite ~10 s on
    the slow CPUs): at most 64 running requests, bodies up to 4 MiB (test_server_robustness.py tests that limit).
    Tests on it leave it as they found it: no request running and the pool free."""
    from tests.server_process import ServerProcess

    s = ServerProcess("--max-num-seqs", "64", "--max-request-body-bytes", "4MiB")
    yield s
    s.stop_checking_the_engine_never_died()


@pytest.fixture(scope="session")
def shared_client(shared_server):
    """The official openai SDK's client of the shared server."""
    import openai

    return openai.OpenAI(base_url=f"{shared_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return str(reference_folder(None))  # transformers' own conversion of the GGUF file, for the comparisons


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def small_q4_k_m(tmp_path_factory) -> Path:
    """A random-weight Llama of 8 small layers written as Q4_K_M (loadtest/models.py), shared by the tests that
    serve one: its writing and its config and tokenizer's conversion take ~15 s."""
    from loadtest.models import Shape, write_model

    shape = Shape("llama", 256, 512, 8, 4, 2, 49160, 10000.0, 2048, tied=False)  # vocab: the tokenizer's, padded
    return write_model(shape, "q4_k_m", tmp_path_factory.mktemp("gguf") / "small-q4_k_m.gguf", seed=1)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 3 * 16  # some prompts span several blocks
    return ids


def greedy_agreement(hf_model, prompt_ids: list[list[int]], outs, refs: list[list[int]]) -> tuple[int, int, list[str]]:
    """How far our greedy outputs (``outs``, generated with logprobs=5) follow transformers' (``refs``) on
    ``prompt_ids``: (prompts identical to the end, tokens before each first divergence summed, "first / length" per
    prompt). Asserts that every divergence is a near tie: each side's token is among the other's top 5. An output
    that stops at EOS where the other goes on diverges there (no token to compare)."""
    identical = matched = 0
    firsts = []
    for ids, out, ref in zip(prompt_ids, outs, refs, strict=True):
        ours = out.outputs[0]
        first = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref, strict=False)) if a != b), None)
        if first is None and len(ours.token_ids) != len(ref):
            first = min(len(ours.token_ids), len(ref))
        firsts.append(f"{len(ref) if first is None else first}/{len(ref)}")
        if first is None:
            identical += 1
            matched += len(ref)
            continue
        matched += first
        if first == min(len(ours.token_ids), len(ref)):
            continue
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + ref[:first]])).logits[0, -1].float()
        assert ours.token_ids[first] in logits.topk(5).indices.tolist(), (ids, first)
        assert ref[first] in ours.logprobs[first], (ids, first)
    return identical, matched, firsts


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, kv_dtype: torch.dtype | None = None,
              kv_round: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
    """transformers' greedy generate, one prompt at a time (no padding), stopping at EOS like we do. With
    ``kv_dtype``, every K/V value is rounded to it as it enters the cache, and attention reads the rounded values
    (the prompt's own too), as a pool of that dtype holds them; ``kv_round`` rounds each [..., head_dim] instead."""
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def rounded(x):
                return kv_round(x) if kv_round is not None else x.to(kv_dtype).to(x.dtype)

            return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)

    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
            past_key_values=RoundingCache(config=model.config) if kv_dtype or kv_round else None,
        )
    return out[0, len(prompt_ids) :].tolist()


TINY_CONFIGS = {
    "llama-gqa-tied": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "llama-mha-untied-llama3-rope": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        sliding_window=None,
    ),
    "qwen2-bias": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen3-qknorm": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
}
# Mixture-of-experts families: more experts than a short step's tokens choose, so steps skip some
MOE_CONFIGS = {
    "qwen3-moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    "qwen2-moe-shared": dict(  # a shared expert, and layer 0 dense (mlp_only_layers)
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    ),
    "mixtral": dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
}


def build_tiny_model(kind: str, folder: Path, tokenizer, vocab_size: int = 512) -> Path:
    """A 2-layer random-weight model of the given family, saved as a Hugging Face folder with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict({**TINY_CONFIGS, **MOE_CONFIGS}[kind])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # NOTE: a wide init makes the logits peaked, so greedy argmax is not decided by rounding-level near-ties.
        initializer_range=0.25,
        **spec,
    )
    torch.manual_seed(sum(map(ord, kind)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if getattr(config, "attention_bias", False) or model_type in ("qwen2", "qwen2_moe"):
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(param, std=0.25)
    if model_type in ("qwen3", "qwen3_moe"):
        for name, param in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                torch.nn.init.uniform_(param, 0.5, 1.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2_tokenizer):
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(kind), smollm2_tokenizer)
        return built[kind]

    return get
