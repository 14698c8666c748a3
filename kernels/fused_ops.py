"""The decoder's elementwise ops as one Triton launch each: RMSNorm (optionally with the residual add before it),
rotary embedding in place, and SiLU-and-multiply; the same four functions, with the same contracts, as
``kernels/cpu`` exports for the C path.

In torch these are 5-14 small kernels each (~40 per layer), and a GPU step of a small model is made of such
launches: even replayed from a CUDA graph, SmolLM2-135M's 30 layers took ~2.4 ms of GPU time at batch 1.

Each kernel computes in fp32 and rounds to the activations' dtype exactly where transformers' torch code does
(``x.to(input_dtype)`` before the norm weight, every product and sum of the rotary in the input dtype, SiLU
before the multiply), so half-precision results follow the reference's rounding steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# NOTE: no FMA contraction: fp32 results then round like torch's separate multiply and add.
_EXACT = {"enable_fp_fusion": False}


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # rows of [T, H, D] or [T, D] (H = 1), any token and head stride
    residual_ptr,  # [T, D] contiguous rows (ADD only): residual += x, then the norm of residual
    w_ptr,  # [D]
    out_ptr,  # [T * H, D] contiguous
    stride_x_tok,
    stride_x_head,
    num_heads,
    dim,
    eps,
    ADD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(x_ptr + (row // num_heads) * stride_x_tok + (row % num_heads) * stride_x_head + offs, mask=mask,
                other=0.0)
    if ADD:
        r = tl.load(residual_ptr + row * dim + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(residual_ptr + row * dim + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / dim
    y = (xf * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * dim + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, H, D], heads contiguous, any token stride; rotated in place
    positions_ptr,  # [T] int64
    cos_ptr,  # [max_position, D] fp32
    sin_ptr,  # [max_position, D] fp32
    stride_x_tok,
    num_heads,
    HALF: tl.constexpr,  # D / 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0)
    pos = tl.load(positions_ptr + tok)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    dt = x_ptr.dtype.element_ty
    # transformers: cos/sin cast to the input dtype, then q * cos + rotate_half(q) * sin, rotate_half = [-x2, x1]
    row = pos * 2 * HALF + offs_d
    cos1 = tl.load(cos_ptr + row, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + row + HALF, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + row, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + row + HALF, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
    p1 = x_ptr + tok * stride_x_tok + offs_h[:, None] * 2 * HALF + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)
    out2 = (x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)
    tl.store(p1, out1.to(dt), mask=mask)
    tl.store(p1 + HALF, out2.to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [M, 2I]: gate then up, rows contiguous inside
    out_ptr,  # [M, I] contiguous
    stride_row,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + offs, (silu * up).to(dt), mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x if x.dim() == 3 else x.unsqueeze(1)  # [T, H, D]
    assert rows.stride(2) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows.shape[0] * rows.shape[1],)](
        rows, residual if residual is not None else rows, weight, out, rows.stride(0), rows.stride(1), rows.shape[1],
        dim, eps, ADD=residual is not None, BLOCK_D=block, num_warps=4 if block <= 2048 else 8, **_EXACT,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` [T, D] or [T, H, D] (the last dimension contiguous) into a new
    contiguous tensor of x's shape."""
    return _norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place (``residual`` [T, D] contiguous), then returns RMSNorm(residual)."""
    assert x.dim() == 2 and residual.is_contiguous() and residual.shape == x.shape
    return _norm(x, residual, weight, eps)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on ``x`` [T, H, D] (heads contiguous, any token stride); ``cos``/``sin`` [max
    position, D] fp32, indexed by ``positions`` [T] int64."""
    t, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim and cos.is_contiguous() and sin.is_contiguous()
    if t:
        _rotary_kernel[(t,)](x, positions, cos, sin, x.stride(0), heads, HALF=head_dim // 2,
                             BLOCK_H=triton.next_power_of_2(heads),
                             BLOCK_HALF=triton.next_power_of_2(head_dim // 2), **_EXACT)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [M, 2I] -> [M, I]."""
    m, two_i = gate_up.shape
    assert gate_up.stride(1) == 1
    out = torch.empty(m, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(two_i // 2))
    if m:
        _silu_mul_kernel[(m, triton.cdiv(two_i // 2, block))](gate_up, out, gate_up.stride(0), two_i // 2,
                                                              BLOCK=block, **_EXACT)
    return out
