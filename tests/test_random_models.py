"""loadtest/models.py: random-weight GGUF models of real shapes, written with gguf-py, read back by gguf-py and
served by the engine."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.gguf_reader import FastGGUFReader
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from loadtest.models import SHAPES, Shape, random_blocks, tensor_types, use_more_bits, write_model

SMALL = Shape("llama", 256, 512, 8, 4, 2, 49160, 10000.0, 2048, tied=False)  # vocab: the tokenizer's, padded


@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_m", "q8_0"])
def test_a_random_model_has_the_mix_and_range_asked_for_and_serves(quant, tmp_path, small_q4_k_m):
    path = small_q4_k_m if quant == "q4_k_m" else write_model(SMALL, quant, tmp_path / f"small-{quant}.gguf", seed=1)
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    expected = tensor_types(SMALL, quant)
    assert {name: types[name] for name in expected} == {name: kind.name for name, kind in expected.items()}
    if quant != "q8_0":  # attn_v and ffn_down of layers 0, 3, 6 and 7 (of 8), and the output, get Q6_K
        assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
        main = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K"}[quant]
        assert Counter(types.values()) == {main: 1 + 8 * 5 + 4 * 2, "Q6_K": 1 + 4 * 2, "F32": 8 * 2 + 1}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        assert np.isfinite(weights).all()
        if tensor.tensor_type.name != "F32":  # (the norms are ones)
            assert np.abs(weights).max() <= 0.06 and 0.005 < weights.std() < 0.04 and abs(weights.mean()) < 0.002
    vocab = next(f for k, f in reader.fields.items() if k == "tokenizer.ggml.tokens").contents()
    assert len(vocab) == SMALL.vocab and vocab[-1] == "<|reserved_special_token_7|>"

    if quant != "q4_k_m":
        return  # one of the two through the engine is enough: both load through the same path
    llm = LLM(str(path), max_model_len=256, kv_cache_memory=16 << 20)
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and llm.engine.vocab_size == SMALL.vocab


def test_a_tied_token_table_gets_the_outputs_type_as_llama_cpp_gives_it(tmp_path, monkeypatch):
    from dataclasses import replace

    from gguf import GGMLQuantizationType as Q

    from loadtest import models

    assert tensor_types(replace(SMALL, tied=True), "q4_k_m")["token_embd.weight"] == Q.Q6_K
    assert tensor_types(SMALL, "q4_k_m")["token_embd.weight"] == Q.Q4_K  # its own output.weight is the Q6_K
    # a cached file of an older mix (the tied table in Q4_K) is written again
    tiny = replace(SMALL, layers=1, tied=True)
    monkeypatch.setitem(models.SHAPES, "tiny", tiny)
    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path))
    stale = tmp_path / "random-models" / "tiny-q4_k_m-seed0.gguf"
    stale.parent.mkdir()
    older = {**tensor_types(tiny, "q4_k_m"), "token_embd.weight": Q.Q4_K}
    monkeypatch.setattr(models, "tensor_types", lambda shape, quant: older)
    write_model(tiny, "q4_k_m", stale)
    monkeypatch.setattr(models, "tensor_types", tensor_types)
    assert models._types_in(FastGGUFReader(stale))["token_embd.weight"] == "Q4_K"
    path = models.cached_model("tiny", "q4_k_m")
    assert path == stale and models._types_in(FastGGUFReader(path))["token_embd.weight"] == "Q6_K"
    written = path.stat().st_mtime_ns
    assert models.cached_model("tiny", "q4_k_m").stat().st_mtime_ns == written  # a current one is kept


def test_a_padded_vocabulary_is_plain_tokens_then_256_special_ones(tmp_path, monkeypatch, smollm2_tokenizer):
    """As Llama 3's ends: a tokenizer of ~100k special tokens (the padding before) took transformers ~5 s to load.
    The padding changes no encoding, and a cached file of the older padding is written again."""
    from dataclasses import replace

    from engine.model_loader import load_tokenizer, resolve_model
    from loadtest import models

    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path))
    tiny = replace(SMALL, layers=1, vocab=SMALL.vocab + 300)
    monkeypatch.setitem(models.SHAPES, "tiny", tiny)
    path = models.cached_model("tiny", "q8_0")
    tokenizer = load_tokenizer(resolve_model(str(path)))
    base, plain = len(smollm2_tokenizer), tiny.vocab - len(smollm2_tokenizer) - 256
    assert len(tokenizer) == tiny.vocab and plain > 0
    assert tokenizer.convert_ids_to_tokens([base, base + plain - 1, base + plain, tiny.vocab - 1]) == [
        "<filler_0>", f"<filler_{plain - 1}>", "<|reserved_special_token_0|>", "<|reserved_special_token_255|>"]
    assert len(tokenizer.added_tokens_decoder) == len(smollm2_tokenizer.added_tokens_decoder) + 256
    text = "Hello there, <filler_3> is text here."
    assert tokenizer.encode(text) == smollm2_tokenizer.encode(text)
    # a file padded all with special tokens, as the generator wrote it before, is not current
    older = models._vocabulary(tiny.vocab)[1][:base] + [models.TokenType.CONTROL] * (tiny.vocab - base)
    monkeypatch.setattr(models, "_vocabulary", lambda vocab: ([], older, None))
    assert not models._is_current(path, tiny, "q8_0")


def test_the_real_shapes_have_k_quant_rows():
    for shape in SHAPES.values():  # every input dimension must hold whole 256-value blocks
        assert shape.hidden % 256 == 0 and shape.intermediate % 256 == 0
        assert shape.hidden % shape.heads == 0 and shape.heads % shape.kv_heads == 0


def test_a_random_bf16_folder_loads_in_transformers_and_serves_without_an_fp32_copy(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from loadtest.models import write_hf_bf16

    shape = Shape("qwen2", 256, 512, 2, 4, 2, 49152, 10000.0, 2048, tied=True, qkv_bias=True)
    folder = write_hf_bf16(shape, tmp_path / "qwen2-small-bf16", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    assert hf.config.torch_dtype == torch.bfloat16 and hf.model.layers[1].self_attn.k_proj.bias.shape == (128,)
    assert abs(hf.model.layers[0].mlp.down_proj.weight.float().std().item() - 0.02) < 0.002
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, kv_cache_memory=16 << 20)
    assert all(p.dtype != torch.float32 or p.dim() == 1 for p in llm.engine.model.parameters())  # norms, biases only
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_random_blocks_of_each_type_decode_to_small_centred_weights(kind):
    """The benchmarks' random blocks (kernel_ab's q4_k ... q8_0) read as weights of a real model's size: within
    ~0.05, their mean near 0 against their spread, whatever the type."""
    weights = dequantize(random_blocks(np.random.default_rng(0), 64, 512, GGMLQuantizationType[kind]),
                         GGMLQuantizationType[kind])
    assert weights.shape == (64, 512)
    assert 0.02 < float(np.abs(weights).max()) < 0.051 and float(weights.std()) > 0.005
    assert abs(float(weights.mean())) < 0.05 * float(weights.std())
