"""Paged prefill / extend attention: a chunk of new query tokens per request, varlen over the flattened batch,
causal against everything in the cache (its cached prefix and the chunk itself, already stored).

Cache layout: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]. Block tables [num_reqs,
max_num_blocks] int32: request r's token t is at block_tables[r, t // block_size], row t % block_size.

    request r:   positions 0 ........ num_cached-1 | num_cached ....... seq_len-1
                 (cached prefix, K/V in the pool)    (this step's queries, query_start_loc[r] .. [r+1])

One program per (request, query head, tile of BLOCK_M queries) walks the request's blocks up to the tile's last
position, with the causal mask key_pos <= query_pos and an online softmax in fp32. The same kernel covers plain
prefill (num_cached = 0), chunked prefill and prefix-cache hits; a one-token chunk is a decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.online_softmax import check_dot_shapes, compute_mode, load_kv_page, online_softmax_step


# NOTE: Triton compiles a variant per stride that is or is not a multiple of 16 and per pointer that is or is not
# 16-byte aligned. The block tables' width varies from step to step, and behind num_decodes decodes the metadata
# starts at block_tables[num_decodes:] and seq_lens[num_decodes:], aligned only for some num_decodes: unspecialized,
# one compiled kernel serves them all, so no step waits for a compile (on an H100, 0.4-0.8 s the first time).
@triton.jit(do_not_specialize=["block_tables_ptr", "seq_lens_ptr", "stride_bt_req"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables_ptr,  # [num_reqs, max_num_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    scale,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_bt_req,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - q_len
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_SIZE)
    mask_m = offs_m < q_len
    q_pos = num_cached + offs_m
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_key = tl.minimum(seq_len, num_cached + (tile + 1) * BLOCK_M)  # no query of this tile sees past it
    for b in range(0, tl.cdiv(last_key, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + req * stride_bt_req + b).to(tl.int64)
        k_pos = b * BLOCK_SIZE + offs_n
        mask_n = k_pos < seq_len
        k, v = load_kv_page(k_cache_ptr, v_cache_ptr, block_id, offs_n, offs_d, mask_n, kv_head, BLOCK_SIZE,
                            NUM_KV_HEADS, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_SIZE]
        visible = (k_pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    out = acc / l_i[:, None]  # every valid query sees at least key 0
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_o_token + head * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32, starting at 0
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    check_dot_shapes(block_size, head_dim, q.device)
    out = torch.empty_like(q) if out is None else out
    num_reqs = seq_lens.shape[0]
    block_m = 64 if q.is_cuda else 16
    upcast, dot_precision = compute_mode(q.dtype)
    grid = (num_reqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, UPCAST=upcast, DOT_PRECISION=dot_precision,
    )
    return out
