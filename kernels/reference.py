"""Plain-torch references for the paged-attention kernels: gather each request's blocks, then softmax attention in
float64, so tests compare the kernels with an answer that has no rounding of its own to speak of."""

from __future__ import annotations

import torch

from kernels import cdiv


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, head_dim] + one block-table row -> [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def ref_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep].long()] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep].long()] = v[keep].to(v_cache.dtype)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first_pos: int) -> torch.Tensor:
    """q [num_q, heads, dim] at positions first_pos.., keys/values [seq, kv_heads, dim]; causal."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    group = heads // kv_heads
    keys = keys.double().repeat_interleave(group, dim=1)  # [seq, heads, dim]
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale  # [heads, num_q, seq]
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)


def ref_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [num_reqs, heads, dim] (one query each, at position seq_len - 1) -> [num_reqs, heads, dim] float64."""
    out = []
    for r in range(q.shape[0]):
        n = int(seq_lens[r])
        keys, values = gather_kv(k_cache, block_tables[r], n), gather_kv(v_cache, block_tables[r], n)
        out.append(_attend(q[r : r + 1], keys, values, scale, n - 1)[0])
    return torch.stack(out)


def ref_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [num_tokens, heads, dim], request r's queries are the last ``query_len`` positions of its ``seq_len``."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(len(seq_lens)):
        start, end, n = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        keys, values = gather_kv(k_cache, block_tables[r], n), gather_kv(v_cache, block_tables[r], n)
        out[start:end] = _attend(q[start:end], keys, values, scale, n - (end - start))
    return out
