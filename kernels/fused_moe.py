"""A mixture of experts' chosen experts as two grouped GEMMs on a GPU (vLLM's ``fused_moe`` layout).

The step's (token, slot) pairs are sorted by expert and each expert's run padded to BLOCK_M rows
(``align_by_expert``), so every program of a launch multiplies BLOCK_M rows by one expert's weight: one launch for
every expert's gate/up (the rows gathered from the tokens), SiLU-and-multiply, one launch for every expert's down
(each row scaled by its routing weight), then each token's k rows summed. Nothing depends on the routing's values
on the host (no ``.item()``, no sizes read back): the launches' grids follow only the step's token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_ops import silu_mul

BLOCK_M = 16  # rows a program multiplies; each expert's run is padded to a multiple of it


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, block_experts): ``pairs`` [capacity] holds the pair indices (token * k + slot) grouped by expert, each
    expert's run padded to a multiple of ``block_m`` with the value T * k (no pair); ``block_experts`` the expert of
    each run of ``block_m`` (padding blocks past the last expert's take the last one's, and multiply nothing)."""
    flat = experts.flatten().to(torch.int64)
    num_pairs = flat.numel()
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - starts[sorted_experts]  # place within its expert's run
    pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    pairs.scatter_(0, padded_starts[sorted_experts] + rank, order)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(torch.cumsum(padded, 0), block_starts, right=True)
    return pairs, block_experts.clamp_(max=num_experts - 1)


@triton.jit
def _expert_gemm_kernel(
    x_ptr,  # rows [R, K]: the tokens (GATHER: row of pair p is p // top_k) or the pairs
    w_ptr,  # [E, N, K]
    out_ptr,  # [num_pairs, N]
    pairs_ptr,  # [capacity]: pair indices grouped by expert, num_pairs where none
    block_experts_ptr,  # [capacity / BLOCK_M]
    scale_ptr,  # [num_pairs] routing weights (SCALE only)
    num_pairs,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    top_k,
    GATHER: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block, pid_n = tl.program_id(0), tl.program_id(1)
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = pair // top_k if GATHER else pair
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + k[:, None],
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    if SCALE:
        acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def _expert_gemm(x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, block_experts: torch.Tensor,
                 num_pairs: int, top_k: int, gather: bool, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[num_pairs, N]: each pair's row of ``x`` times its expert's ``w`` [E, N, K] (transposed), scaled where given."""
    n, k = w.shape[1], w.shape[2]
    assert x.stride(1) == 1 and w.is_contiguous() and x.shape[1] == k
    out = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
    block_n, block_k = min(64, triton.next_power_of_2(n)), min(64, max(16, triton.next_power_of_2(k)))
    grid = (pairs.numel() // BLOCK_M, triton.cdiv(n, block_n))
    _expert_gemm_kernel[grid](x, w, out, pairs, block_experts, scale if scale is not None else out, num_pairs, n, k,
                              x.stride(0), w.stride(0), w.stride(1), out.stride(0), top_k, GATHER=gather,
                              SCALE=scale is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token's chosen experts' SwiGLU (``w13`` [E, 2I, H]: gate rows then up rows; ``w2`` [E, H, I]),
    weighted by ``weights`` [T, k] and summed over its k experts."""
    t, top_k = experts.shape
    num_pairs = t * top_k
    pairs, block_experts = align_by_expert(experts, w13.shape[0])
    gate_up = _expert_gemm(x, w13, pairs, block_experts, num_pairs, top_k, gather=True)
    act = silu_mul(gate_up)
    down = _expert_gemm(act, w2, pairs, block_experts, num_pairs, top_k, gather=False,
                        scale=weights.flatten().to(x.dtype).contiguous())
    return down.view(t, top_k, -1).sum(dim=1)
