"""store_kv: write the new tokens' K and V into the paged pool through the slot mapping.

Cache layout: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; slot s is row
``s // block_size, s % block_size``. A slot of -1 marks a padded lane and is skipped.
One program per token; it copies num_kv_heads * head_dim values for K and for V, rounding fp32 values to nearest
even where the pool is bfloat16 (``kv_cache_dtype``), as torch's conversion and the C kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_token,
    stride_v_token,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK_ROW: tl.constexpr,  # ROW rounded up to a power of two
    ROUND_TO_BF16: tl.constexpr,  # fp32 K/V into a bfloat16 pool
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_ROW)
    mask = offs < ROW
    k = tl.load(k_ptr + token * stride_k_token + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + offs, mask=mask)
    if ROUND_TO_BF16:
        k, v = _round_to_bf16(k), _round_to_bf16(v)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> bfloat16 rounded to nearest even, in integer arithmetic. NOTE: the interpreter's own float cast
    truncates, so the tests on a CPU would check another rounding than a GPU's."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)  # NaN stays NaN
    return rounded.to(tl.bfloat16, bitcast=True)


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and k.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK_ROW=triton.next_power_of_2(row),
        ROUND_TO_BF16=k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16,
    )
