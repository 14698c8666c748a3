"""Paged decode attention: one query token per request, read straight from the KV blocks, in two stages.

Cache layout: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]. Block tables [num_reqs,
max_num_blocks] int32: request r's token t is at block_tables[r, t // block_size], row t % block_size.

Stage 1, one program per (request, KV head, split): loads the whole group of query heads that share the KV head
(GQA; padded to BLOCK_H rows for tl.dot), walks its split's share of the request's blocks reading each block once,
and keeps an online softmax in fp32. It writes the split's normalised output and its log-sum-exp.

    request's blocks:  [ b0 b1 b2 | b3 b4 b5 | b6 b7 ]      num_splits = 3, blocks_per_split = cdiv(8, 3) = 3
                         split 0    split 1    split 2

Stage 2, one program per (request, query head): merges the splits' outputs weighted by exp(lse - max lse).
The split count depends only on batch size, KV heads and the GPU's SM count; sequence lengths are read inside the
kernels, so the launch shape is the same for every step of a given batch size (CUDA-graph friendly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.online_softmax import check_dot_shapes, compute_mode, load_kv_page, online_softmax_step

MAX_SPLITS = 32


# NOTE: the block tables' width varies from step to step (the longest table of an eager step; a fixed width in
# the CUDA graphs), and Triton compiles a variant per stride that is or is not a multiple of 16: unspecialized,
# one compiled kernel serves both, so no step of a new width waits for a compile.
@triton.jit(do_not_specialize=["stride_bt_req"])
def _decode_split_kernel(
    q_ptr,  # [num_reqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    mid_out_ptr,  # [num_reqs, num_heads, num_splits, head_dim] fp32
    mid_lse_ptr,  # [num_reqs, num_heads, num_splits] fp32
    scale,
    num_splits,
    stride_q_req,
    stride_q_head,
    stride_bt_req,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP padded to a tl.dot-friendly power of two (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 after loading (the interpreter's half-precision math is wrong)
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(num_blocks, num_splits)
    first_block = split * blocks_per_split
    last_block = tl.minimum(first_block + blocks_per_split, num_blocks)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_SIZE)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    q = tl.load(q_ptr + req * stride_q_req + heads[:, None] * stride_q_head + offs_d[None, :], mask=mask_h[:, None],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for b in range(first_block, last_block):
        block_id = tl.load(block_tables_ptr + req * stride_bt_req + b).to(tl.int64)
        mask_n = b * BLOCK_SIZE + offs_n < seq_len
        k, v = load_kv_page(k_cache_ptr, v_cache_ptr, block_id, offs_n, offs_d, mask_n, kv_head, BLOCK_SIZE,
                            NUM_KV_HEADS, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_H, BLOCK_SIZE]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    has_keys = l_i > 0  # a split past the end of a short sequence saw no key
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    mid = (req * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
    tl.store(mid_out_ptr + mid[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_h[:, None])
    tl.store(mid_lse_ptr + mid, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    mid_out_ptr,  # [num_reqs, num_heads, num_splits, head_dim] fp32
    mid_lse_ptr,  # [num_reqs, num_heads, num_splits] fp32
    out_ptr,  # [num_reqs, num_heads, head_dim]
    num_splits,
    stride_o_req,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < num_splits
    base = (req * NUM_HEADS + head) * num_splits
    lse = tl.load(mid_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(mid_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None],
                    other=0.0)
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(out_ptr + req * stride_o_req + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice over; a large batch needs no split at all."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * num_sms, num_reqs * num_kv_heads)))


def decode_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, head_dim]
) -> torch.Tensor:
    num_reqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    check_dot_shapes(block_size, head_dim, q.device)
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, num_kv_heads, q.device)
    out = torch.empty_like(q) if out is None else out
    mid_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    upcast, dot_precision = compute_mode(q.dtype)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_out, mid_lse, scale, num_splits,
        q.stride(0), q.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, UPCAST=upcast, DOT_PRECISION=dot_precision,
    )
    _decode_merge_kernel[(num_reqs, num_heads)](
        mid_out, mid_lse, out, num_splits, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SPLITS=triton.next_power_of_2(num_splits),
    )
    return out
