"""Attention over the paged KV cache for one flattened batch, the metadata that describes that batch, and the
plain-torch attention every backend's is checked against (``engine/backends`` holds the others).

    flattened batch (num_tokens = 1 + 1 + 5):   [ d0 | d1 | p2 p2 p2 p2 p2 ]
    query_start_loc:                            [0,   1,   2,            7]
    seq_lens (context after this step):         [ 40,  17,  5 + num_computed of request 2 ]

Requests with a single query token (decodes) come first in the batch, so the torch path attends all of them
in one padded call; prefill and chunked-prefill requests follow and each attends its cached prefix plus its
own chunk causally.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cdiv, kv_int8


@dataclass
class AttentionMetadata:
    """Everything an attention backend needs to know about the batch; passed explicitly down the forward."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token (block_id * block_size + offset)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: where each request's tokens start in the batch
    seq_lens: torch.Tensor  # [num_reqs] int32: context length of each request once this step's tokens are in
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32, rows padded with 0 past each table's end
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch path loops over prefills without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    req_of_token: torch.Tensor  # [num_tokens] int64, on the host: the request of each token, computed once a step

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_prefill_seq_len(self) -> int:
        """The longest context among the requests past the decodes (0 where every request decodes)."""
        return max(self.seq_lens_cpu[self.num_decodes :], default=0)

    def to(self, device: torch.device) -> AttentionMetadata:
        return dataclasses.replace(
            self, slot_mapping=self.slot_mapping.to(device), query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device), block_tables=self.block_tables.to(device),
        )


class TorchAttention:
    """Paged attention in plain torch: writes the new K/V into the pool, then gathers each request's blocks.

    The reference the other backends are checked against end to end, and the CPU fallback. Every backend runs the
    same three stages (``forward``) and overrides the ones it does its own way.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            self.decode(q[:nd], k_cache, v_cache, meta, out[:nd])
        if nd < meta.num_reqs:
            self.prefill(q, k, v, k_cache, v_cache, meta, out)
        return out

    def store(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        store_kv(k, v, k_cache, v_cache, slots)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor
    ) -> None:
        """The first ``num_decodes`` requests, one query token each, into ``out``."""
        nd = q.shape[0]
        out[:] = self._decode(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd])

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """The requests after the decodes (prefill or chunked-prefill queries), each into its rows of ``out``."""
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_decodes, meta.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta.block_tables[i], seq_lens[i]
            )

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        block_size = k_cache.shape[1]
        max_len = int(seq_lens.max())
        num_blocks = cdiv(max_len, block_size)
        table = block_tables[:, :num_blocks].long()
        # [nd, num_blocks * block_size, kv_heads, head_dim] -> [nd, kv_heads, L, head_dim]
        keys = kv_int8.read(k_cache[table], q.dtype).flatten(1, 2).transpose(1, 2)
        values = kv_int8.read(v_cache[table], q.dtype).flatten(1, 2).transpose(1, 2)
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [nd, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
    ) -> torch.Tensor:
        num_query = q.shape[0]
        num_cached = seq_len - num_query
        if num_cached == 0:
            # Nothing cached before this chunk: attend the fresh K/V directly, as transformers does, as the pool holds
            # them (rounded to a narrower pool's type), so a prompt sees what a later chunk or decode of it will.
            keys, values, mask = as_stored(k, k_cache), as_stored(v, v_cache), None
        else:
            block_size = k_cache.shape[1]
            table = block_table[: cdiv(seq_len, block_size)].long()
            keys = kv_int8.read(k_cache[table].flatten(0, 1)[:seq_len], q.dtype)  # [seq_len, kv_heads, head_dim]
            values = kv_int8.read(v_cache[table].flatten(0, 1)[:seq_len], q.dtype)
            # Query i sits at position num_cached + i and sees keys 0 ..= num_cached + i.
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(num_cached, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [num_query, seq_len]
        # NOTE: the CPU flash kernel takes neither enable_gqa nor 3-D inputs (either falls back to the 2-5x slower
        # math path), so the KV heads are expanded to the query heads, as transformers' repeat_kv does, and a batch
        # dimension of 1 is added.
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)[None]  # [1, num_heads, seq_len, head_dim]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale
        )
        return out[0].transpose(0, 1)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` as a pool of ``cache``'s dtype holds it, back in ``x``'s dtype."""
    return x if cache.dtype == x.dtype else kv_int8.read(kv_int8.to_pool(x, cache.dtype), x.dtype)


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, kv_int8.to_pool(k, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, kv_int8.to_pool(v, v_cache.dtype))
