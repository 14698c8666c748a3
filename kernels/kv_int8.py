"""The int8 K/V pool's rows (``kv_cache_dtype="int8"``): each position's head of ``head_dim`` values stored as
``head_dim`` int8 and, after them, its float32 scale (4 bytes): the row is ``d q`` with ``d = max |x| / 127`` and
``q = x / d`` rounded to nearest even. A pool's last dimension is therefore ``head_dim + SCALE_BYTES`` bytes.

Why: a decode step reads every cached position of every running sequence, and at 64 clients of SmolLM2-135M on a
2-core CPU that reading was ~20% of the step (docs/history/benchmarks-2026-12.md). int8 halves the bytes of a bfloat16
pool (and doubles its tokens in the same memory), at the cost of one rounding per value of at most half a step of its
row's max / 127; it is not exact, so it is opt-in, like vLLM's fp8 pool.

These torch functions are the format's definition: the C kernels (``hp_store_kv``, ``hp_paged_decode_attention``)
write the same bytes and read them the same way, and the plain-torch attention reads a pool through them.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 after each head's values


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> int8 [..., head_dim + SCALE_BYTES]: the bytes a pool row holds."""
    x = x.float()
    d = x.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, d.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 pool rows [..., head_dim + SCALE_BYTES] -> their values [..., head_dim] in ``dtype`` (``d q``, in fp32)."""
    d = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * d).to(dtype)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a pool's last dimension: ``head_dim``, or for int8 the values and their scale's bytes."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def read(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a pool of any dtype, as values in ``dtype``."""
    return dequantize_rows(cache_rows, dtype) if cache_rows.dtype == torch.int8 else cache_rows.to(dtype)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """``x`` [..., head_dim] as a pool of ``pool_dtype`` stores it."""
    return quantize_rows(x) if pool_dtype == torch.int8 else x.to(pool_dtype)
