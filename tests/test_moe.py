"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): greedy tokens equal transformers' on tiny random
checkpoints, routing as transformers routes, and a GGUF file's expert blocks read as gguf-py reads them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from engine import LLM, SamplingParams
from engine.models.llama import head_dim_of
from engine.models.moe import SparseMoeBlock, num_experts_of, route
from loadtest.models import Shape, write_model
from tests.conftest import MOE_CONFIGS, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=16)
TINY_MOE = Shape("qwen3moe", 256, 512, 2, 4, 2, 49160, 1e6, 2048, tied=False, head_dim=64, qk_norm=True,
                 experts=8, experts_used=2, expert_ff=256)  # vocab: the tokenizer's, padded


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kind", sorted(MOE_CONFIGS))
def test_moe_greedy_matches_transformers_batched_and_chunked(kind, backend, tiny_model):
    folder = tiny_model(kind)
    prompts = _prompts(0, (1, 3, 5, 17, 40))
    expected = [hf_greedy(_hf(folder), p, 16) for p in prompts]
    # 4-token blocks and a 16-token budget: chunked prefill of the long prompts beside the others' decodes
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              attention_backend=backend)
    assert isinstance(llm.engine.model.layers[1].mlp, SparseMoeBlock)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_moe_on_the_triton_backend_matches_transformers(tiny_model):
    """The GPU backend's path, interpreted here: Triton attention and the experts as grouped GEMMs (no CUDA graphs)."""
    folder = tiny_model("qwen2-moe-shared")
    prompts = _prompts(7, (1, 9))
    expected = [hf_greedy(_hf(folder), p, 8) for p in prompts]
    llm = LLM(str(folder), attention_backend="triton", max_num_batched_tokens=16, kv_cache_memory=4 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_qwen2_moe_keeps_dense_layers_and_the_gated_shared_expert(tiny_model):
    llm = LLM(str(tiny_model("qwen2-moe-shared")), kv_cache_memory=4 << 20)
    dense, sparse = (layer.mlp for layer in llm.engine.model.layers)
    assert not isinstance(dense, SparseMoeBlock)  # mlp_only_layers=[0]
    assert sparse.shared_expert is not None and sparse.shared_expert_gate.out_features == 1


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_moe_greedy_matches_transformers_with_prefix_hits_and_preemption(kind, tiny_model):
    """Prompts sharing a 24-token prefix (cache hits) in a pool too small for all of them at once (preemption)."""
    folder = tiny_model(kind)
    prefix = _prompts(1, (24,))[0]
    prompts = [prefix + tail for tail in _prompts(2, (3, 9, 14, 6, 11, 2))]
    expected = [hf_greedy(_hf(folder), p, 16) for p in prompts]
    config = _hf(folder).config
    per_block = 4 * 2 * 2 * config.num_key_value_heads * head_dim_of(config) * 4  # 4 tokens, 2 layers, K and V, fp32
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=32, enable_prefix_caching=True,
              kv_cache_memory=24 * per_block)
    assert llm.engine.kv_cache.num_blocks == 24
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], GREEDY)] == expected[::-1]
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_hit_tokens > 0
    engine.block_manager.check_integrity()


def test_routing_ties_go_as_torch_topk_breaks_them():
    """Four experts with the very same router row: transformers' router picks among them by ``torch.topk``'s
    order, and so does ours (the same experts and weights, for rows where the tie decides)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = AutoConfig.for_model("qwen3_moe", hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                  norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(config)
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    weight[[1, 3, 4, 6]] = weight[3].clone()  # tied logits for every token
    router.weight.data.copy_(weight)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ref_weights, ref_experts = router(x)
    weights, experts = route(torch.nn.functional.linear(x, weight), 3, norm=True)
    assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
    tied = (ref_experts.unsqueeze(-1) == torch.tensor([1, 3, 4, 6])).any(-1).sum(-1)
    assert ((tied > 0) & (tied < 3)).any(), "some rows took part of the tied group: the tie decided"


def test_a_decode_step_runs_each_chosen_expert_once_over_its_tokens(tiny_model):
    """On the modules (the torch backend's path) a step of T tokens runs at most min(E, T k) experts, each over
    exactly the tokens that chose it."""
    llm = LLM(str(tiny_model("qwen3-moe")), kv_cache_memory=4 << 20, attention_backend="torch")
    block = llm.engine.model.layers[1].mlp
    calls: list[int] = []
    for expert in block.experts:
        expert.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    steps: list[int] = []
    block.register_forward_hook(lambda module, args, out: steps.append(len(calls)))
    llm.generate([[5, 6, 7], [9, 10], [11]], SamplingParams(temperature=0, max_tokens=4))
    per_step = np.diff([0, *steps])
    assert (per_step <= np.minimum(8, 2 * np.array([6, 3, 3, 3])[:len(per_step)])).all()
    assert sum(calls) == 2 * (6 + 3 * 3), "every token's two experts, and no more"


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen2-moe-shared"])
def test_the_c_block_computes_what_the_modules_compute(kind, tiny_model):
    """The CPU backend's one-call block (``kernels/cpu/moe.c``), both ways of sharing the threads, against the
    modules one expert a call: tokens that chose the same experts, an expert no token chose, the shared expert; and
    its routing against torch's, a tie at the k-th place reported."""
    # the C panels (start-up may time oneDNN's products faster for a tiny fp32 model, which have no C block)
    llm = LLM(str(tiny_model(kind)), kv_cache_memory=4 << 20, attention_backend="cpu", gemm_kernels="c")
    block = llm.engine.model.layers[1].mlp
    c_block, e, k = block.kernel.block, block.num_experts, block.top_k
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, block.gate.in_features, generator=g)
    experts = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(9)])
    experts[3] = experts[0]
    weights = torch.rand(9, k, generator=g)
    block.kernel = None
    with torch.no_grad():
        expected = block.run_experts(x, experts, weights)
        if block.shared_expert is not None:
            expected = expected + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        for split in (True, False):
            c_block.split = split
            torch.testing.assert_close(c_block.experts(x, experts, weights), expected, rtol=1e-5, atol=1e-5)
        ref_weights, ref_experts = route(block.gate(x), k, block.norm_topk_prob)
    got_experts, got_weights, ties = c_block.route(x)
    assert torch.equal(got_experts.long(), ref_experts) and ties == 0
    torch.testing.assert_close(got_weights, ref_weights, rtol=1e-5, atol=1e-6)
    zero = torch.zeros(1, block.gate.in_features)  # every logit 0: E-way tie
    assert c_block.route(zero)[2] == 1


def test_a_tie_at_the_kth_expert_is_broken_as_transformers_breaks_it(tiny_model, tmp_path, smollm2_tokenizer):
    """Routers whose rows repeat tie every token at the k-th place: the one-call decoder reports the tie and the
    step runs on the modules, where torch.topk picks as transformers does; the tokens are transformers'."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3-moe"), dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = layer.mlp.gate.weight
            gate[2:6] = gate[1].clone()  # experts 1-5 always tie; with k = 2 the k-th place is often among them
    hf.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    prompts = _prompts(8, (3, 11))
    expected = [hf_greedy(hf.eval(), p, 12) for p in prompts]
    llm = LLM(str(tmp_path), kv_cache_memory=4 << 20, attention_backend="cpu", max_num_batched_tokens=16,
              gemm_kernels="c")
    backend, results = llm.engine.backend, []
    decoder = backend.decoder

    def counted(*args):
        results.append(decoder(*args))
        return results[-1]

    backend.decoder = counted
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert any(r is None for r in results), "some steps tied, and went to the modules"


@pytest.fixture(scope="module")
def tiny_moe_gguf(tmp_path_factory):
    return write_model(TINY_MOE, "q4_k_m", tmp_path_factory.mktemp("moe") / "tiny-moe-q4_k_m.gguf", seed=3)


@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_m", "q8_0"])
def test_gguf_expert_blocks_decode_as_gguf_py_dequantizes_them(quant, tiny_moe_gguf, tmp_path):
    """Each expert's weight, a view of the file's experts tensor, dequantizes to gguf-py's values bit for bit."""
    from engine.gguf_weights import iter_gguf_weights

    path = tiny_moe_gguf if quant == "q4_k_m" else write_model(TINY_MOE, quant, tmp_path / "moe.gguf", seed=4)
    reference = {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(path).tensors}
    weights = dict(iter_gguf_weights(str(path), TINY_MOE.heads, TINY_MOE.kv_heads))
    types = set()
    for layer in range(TINY_MOE.layers):
        for gguf_name, hf in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"),
                              ("ffn_down_exps", "down_proj")):
            whole = reference[f"blk.{layer}.{gguf_name}.weight"]
            assert whole.shape[0] == TINY_MOE.experts
            for e in range(TINY_MOE.experts):
                blocks = weights[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"]
                types.add(blocks.ggml_type)
                assert torch.equal(blocks.dequantize(), torch.from_numpy(whole[e].astype(np.float32)))
        router = weights[f"model.layers.{layer}.mlp.gate.weight"]
        assert torch.equal(router, torch.from_numpy(reference[f"blk.{layer}.ffn_gate_inp.weight"]))
    assert types == {"q4_k_m": {"Q4_K", "Q6_K"}, "q5_k_m": {"Q5_K", "Q6_K"}, "q8_0": {"Q8_0"}}[quant]  # Q6_K: down


def test_a_random_30b_a3b_shape_has_the_mix_llama_cpp_gives_it():
    from loadtest.models import SHAPES, tensor_types, use_more_bits

    shape = SHAPES["qwen3-30b-a3b"]
    types = tensor_types(shape, "q4_k_m")
    assert types["blk.0.ffn_down_exps.weight"].name == "Q6_K" and use_more_bits(0, 48)
    assert types["blk.7.ffn_down_exps.weight"].name == "Q4_K" and not use_more_bits(7, 48)
    assert types["blk.7.ffn_gate_exps.weight"].name == "Q4_K" and types["output.weight"].name == "Q6_K"


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a ``llama`` file's q/k rows (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_q8_gguf(hf, arch: str, path) -> dict[str, torch.Tensor]:
    """``hf``'s weights in a GGUF file as llama.cpp's converter names them, every matrix Q8_0 (the router and norms
    fp32); returns the HF state with each matrix replaced by gguf-py's dequantization of its blocks."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from loadtest.models import _tokenizer

    c, state = hf.config, {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    writer = GGUFWriter(path, arch)
    for add, value in (("context_length", c.max_position_embeddings), ("embedding_length", c.hidden_size),
                       ("block_count", c.num_hidden_layers), ("feed_forward_length", c.intermediate_size),
                       ("head_count", heads), ("head_count_kv", kv_heads), ("rope_freq_base", 1e6),
                       ("layer_norm_rms_eps", c.rms_norm_eps), ("vocab_size", c.vocab_size),
                       ("expert_count", num_experts_of(c)), ("expert_used_count", c.num_experts_per_tok)):
        getattr(writer, f"add_{add}")(value)
    head_dim = head_dim_of(c)
    writer.add_rope_dimension_count(head_dim)
    if arch != "llama":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    _tokenizer(writer, c.vocab_size)
    reference = {}

    def q8(gguf_name: str, hf_name: str | None, w: np.ndarray, order: int | None = None) -> np.ndarray:
        blocks = quantize(w, GGMLQuantizationType.Q8_0)
        values = dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(w.shape)
        stored = _permuted(blocks, order) if order else blocks
        writer.add_tensor(gguf_name, stored, raw_dtype=GGMLQuantizationType.Q8_0)
        if hf_name:
            reference[hf_name] = torch.from_numpy(values.copy())
        return values

    def f32(gguf_name: str, hf_name: str) -> None:
        writer.add_tensor(gguf_name, state[hf_name].astype(np.float32))

    f32("output_norm.weight", "model.norm.weight")
    q8("token_embd.weight", "model.embed_tokens.weight", state["model.embed_tokens.weight"])
    q8("output.weight", "lm_head.weight", state["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f32(b + "attn_norm.weight", p + "input_layernorm.weight")
        f32(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        if p + "self_attn.q_norm.weight" in state:
            f32(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight")
            f32(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight")
        llama = arch == "llama"
        for g, h, n in (("attn_q", "q_proj", heads), ("attn_k", "k_proj", kv_heads), ("attn_v", "v_proj", 0),
                        ("attn_output", "o_proj", 0)):
            q8(f"{b}{g}.weight", f"{p}self_attn.{h}.weight", state[f"{p}self_attn.{h}.weight"], n if llama else None)
            if f"{p}self_attn.{h}.bias" in state:
                f32(f"{b}{g}.bias", f"{p}self_attn.{h}.bias")
        f32(b + "ffn_gate_inp.weight", p + "mlp.gate.weight")
        if p + "mlp.shared_expert_gate.weight" in state:  # Qwen2-MoE: llama.cpp writes the gate's row as a vector
            writer.add_tensor(b + "ffn_gate_inp_shexp.weight", state[p + "mlp.shared_expert_gate.weight"][0])
            for g, h in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")):
                name = f"{p}mlp.shared_expert.{h}.weight"
                q8(f"{b}{g}.weight", name, state[name])
        gate_up, down = state[p + "mlp.experts.gate_up_proj"], state[p + "mlp.experts.down_proj"]
        gate, up = np.split(gate_up, 2, axis=1)
        gate, up = q8(b + "ffn_gate_exps.weight", None, gate), q8(b + "ffn_up_exps.weight", None, up)
        reference[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate([gate, up], axis=1))
        q8(b + "ffn_down_exps.weight", p + "mlp.experts.down_proj", down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


@pytest.mark.parametrize("model_type, arch", [
    ("qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2moe"), ("mixtral", "llama"),
])
def test_a_moe_gguf_gives_transformers_greedy_tokens_on_its_dequantized_weights(model_type, arch, tmp_path):
    """A tiny Qwen3-MoE written as qwen3moe, a Qwen2-MoE (q/k/v biases, the gated shared expert) as qwen2moe, and a
    Mixtral as a ``llama`` file with experts (its q/k rows interleaved as llama.cpp's converter writes them), Q8_0:
    served from the file's blocks (exact products), the greedy tokens are transformers' on gguf-py's dequantization
    of the same blocks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, norm_topk_prob=True, head_dim=32),
             "qwen2_moe": dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                               norm_topk_prob=False),
             "mixtral": dict(num_local_experts=4, sliding_window=None)}[model_type]
    config = AutoConfig.for_model(model_type, vocab_size=TINY_MOE.vocab, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_experts_per_tok=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                                  rope_theta=1e6, initializer_range=0.25, tie_word_embeddings=False, **extra)
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, param in hf.named_parameters():
        if name.endswith("bias"):  # Qwen2-MoE's q/k/v biases start at zero
            torch.nn.init.normal_(param, std=0.25)
    reference = _write_q8_gguf(hf, arch, tmp_path / "tiny-moe-q8_0.gguf")
    hf.load_state_dict(reference, strict=False)
    prompts = _prompts(6, (1, 7, 20))
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(tmp_path / "tiny-moe-q8_0.gguf"), kv_cache_memory=4 << 20, quantized_matmul="exact",
              max_num_batched_tokens=16)
    assert llm.engine.hf_config.architectures == [type(hf).__name__]
    assert isinstance(llm.engine.model.layers[0].mlp, SparseMoeBlock)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_fused_experts_kernel_matches_one_expert_at_a_time():
    """The grouped GEMMs (interpreted here) against each expert's SwiGLU in torch: tokens that chose the same expert
    twice over a step, an expert no token chose, runs padded to BLOCK_M rows."""
    from kernels.fused_moe import BLOCK_M, align_by_expert, fused_experts

    g = torch.Generator().manual_seed(0)
    t, e, k, h, i = 21, 6, 2, 32, 48
    x, w13 = torch.randn(t, h, generator=g), torch.randn(e, 2 * i, h, generator=g)
    w2 = torch.randn(e, h, i, generator=g)
    experts = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])  # expert e - 1: none
    weights = torch.rand(t, k, generator=g)
    pairs, block_experts = align_by_expert(experts, e)
    assert pairs.numel() % BLOCK_M == 0 and sorted(pairs[pairs < t * k].tolist()) == list(range(t * k))
    for b, expert in enumerate(block_experts.tolist()):
        run = pairs[b * BLOCK_M:(b + 1) * BLOCK_M]
        assert (experts.flatten()[run[run < t * k]] == expert).all()
    expected = torch.zeros(t, h)
    for j in range(e):
        rows, slots = (experts == j).nonzero(as_tuple=True)
        gate, up = (x[rows] @ w13[j].T).chunk(2, dim=-1)
        expected.index_add_(0, rows, (torch.nn.functional.silu(gate) * up) @ w2[j].T * weights[rows, slots, None])
    torch.testing.assert_close(fused_experts(x, w13, w2, experts, weights), expected, rtol=1e-4, atol=1e-4)
