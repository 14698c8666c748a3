"""The fused elementwise Triton ops against the torch code they replace (the modules with no ops set), on strided
views like those the decoder passes: fp32 under the interpreter on CPU; fp32 and bfloat16 on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine.models.llama import RMSNorm
from engine.models.rotary import RotaryEmbedding
from kernels import fused_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32: a few ulps (the reductions sum in another order); bf16: one rounding step where fp32 ulps tip it
    tol = 1e-5 if actual.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 64, 100])
def test_rms_norm_and_add_rms_norm_match_torch(dim, dtype):
    gen = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.rand(dim, generator=gen) + 0.5
    norm = norm.to(DEVICE, dtype)
    x = (torch.randn(7, dim, generator=gen) * 3).to(DEVICE, dtype)
    residual = torch.randn(7, dim, generator=gen).to(DEVICE, dtype)
    expected, expected_residual = norm(x, residual.clone())
    got_residual = residual.clone()
    got = fused_ops.add_rms_norm(x, got_residual, norm.weight, norm.eps)
    assert torch.equal(got_residual, expected_residual)  # one rounded add, as torch does it
    assert_close(got, expected)
    assert_close(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    # per-head norm (Qwen3's q/k norm) on a strided [T, H, D] view of a wider row
    wide = torch.randn(5, 4 * dim + 3, generator=gen).to(DEVICE, dtype)
    heads = wide[:, 3:].view(5, 4, dim)
    assert_close(fused_ops.rms_norm(heads, norm.weight, norm.eps), norm(heads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "head_dim"), [(9, 64), (4, 80), (32, 128)])
def test_rotary_in_place_matches_torch(num_heads, head_dim, dtype):
    config = LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads, rope_theta=10000.0)
    with torch.device(DEVICE):
        rotary = RotaryEmbedding(config, head_dim, 4096)
    gen = torch.Generator().manual_seed(head_dim)
    t, kv_heads = 6, 3
    qkv = torch.randn(t, (num_heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 17, 200, 4095, 3], device=DEVICE)
    q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    v_before = qkv[:, (num_heads + kv_heads) * head_dim :].clone()
    fused_ops.rotary_(q, positions, rotary.cos_cache, rotary.sin_cache)
    fused_ops.rotary_(k, positions, rotary.cos_cache, rotary.sin_cache)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(qkv[:, (num_heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 3000])
def test_silu_mul_matches_torch(inter, dtype):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter + 8, generator=gen) * 4).to(DEVICE, dtype)[:, 8:]  # strided rows
    gate, up = gate_up.split(inter, dim=-1)
    assert_close(fused_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
