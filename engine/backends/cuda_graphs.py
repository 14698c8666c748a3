"""Small steps replayed from CUDA graphs: one launch per step instead of one per operation.

A GPU step of a small model is bound by the host launching kernels, not by the GPU: SmolLM2-135M issues over a
thousand small ones a step (30 layers of torch ops plus three Triton launches each): a decode step at batch 1-64
took 32-45 ms eagerly on an H100 and 3.3-5.7 ms replayed from a graph. So every step of up to ``MAX_NUM_TOKENS``
tokens, decodes and short prompt chunks alike, is captured once per token-count bucket at start-up and replayed.

A graph fixes its shapes, so each token is treated as its own decode query: token t of request r, at position p,
attends positions 0..p of r through r's block table, which is causal attention over a prompt chunk and its prefix
(all of the chunk's K/V is stored before any attention runs). The host fills static buffers and pads the step up
to its bucket:

    tokens:  [ d0 | d1 | p2 p2 p2 | pad pad pad ]      bucket 8 for 6 tokens
    request:   0    1    2  2  2    0   0   0          row of the request block tables each token attends through
    slot:      s    s    s  s  s   -1  -1  -1          padding stores nothing (store_kv skips slot -1)

Padding attends position 0 of whatever block its table row starts with (the pool is zero-filled, so finite) and
its rows are never read. Larger steps, and prompt chunks past ``MAX_PREFILL_CONTEXT`` positions (where a query
per token re-reads the whole prefix), run eagerly with the varlen prefill kernel.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from kernels import cdiv

logger = logging.getLogger(__name__)

# NOTE: in a graph each prompt token re-reads its whole prefix, which the varlen prefill kernel reads once per tile
# of queries, so long chunks (past MAX_PREFILL_CONTEXT) stay eager; so do steps past MAX_NUM_TOKENS (bursts of new
# prompts), where each larger bucket would be one more capture at start-up. Neither bound is tuned yet: the
# 256-client bursts of docs/history/benchmarks-2026-11.md run eagerly.
MAX_NUM_TOKENS = 512
MAX_PREFILL_CONTEXT = 1024


def bucket_sizes(max_num_tokens: int) -> list[int]:
    # NOTE: the buckets thin out as they grow: padding 1-63 tokens onto a step of hundreds costs little next to its
    # own tokens, and each bucket is a capture at start-up.
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, 257, 32), *range(320, 1 << 20, 64)]
    return [s for s in sizes if s < max_num_tokens] + [max_num_tokens]


class CudaGraphs:
    """Owns the static input buffers and one captured forward per bucket; ``run`` replays the smallest bucket that
    holds the step. Where the device is not CUDA (tests), ``run`` calls the same forward on the same buffers
    eagerly, so the padding and the per-token metadata are checked without a GPU."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_cache.layers
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(min(MAX_NUM_TOKENS, max_num_batched_tokens))
        self.max_num_tokens = self.sizes[-1]
        self.max_num_seqs = max_num_seqs
        max_blocks = cdiv(max_model_len, kv_cache.spec.block_size)
        pinned = device.type == "cuda"
        # Rows: input ids, positions, slots, request row of each token. Padding as in the module docstring.
        self._host_tokens = torch.zeros(4, self.max_num_tokens, dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, pin_memory=pinned)
        self.tokens = torch.zeros(4, self.max_num_tokens, dtype=torch.int64, device=device)
        self.tokens[2] = -1
        self.block_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_num_tokens + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.pool_bytes = 0
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._capture()

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a step with this (host) metadata can run from a graph."""
        return (meta.slot_mapping.shape[0] <= self.max_num_tokens and meta.num_reqs <= self.max_num_seqs
                and meta.max_prefill_seq_len <= MAX_PREFILL_CONTEXT)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step that ``fits``; host tensors in, a view of the bucket's
        output buffer out (valid until the next ``run``)."""
        n, r = input_ids.shape[0], meta.num_reqs
        size = next(s for s in self.sizes if s >= n)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the pinned buffers
        host = self._host_tokens
        host[0, :n], host[1, :n], host[2, :n] = input_ids, positions, meta.slot_mapping
        host[3, :n] = meta.req_of_token
        host[:, n:size] = 0
        host[2, n:size] = -1
        self._host_tables[:r, : meta.block_tables.shape[1]] = meta.block_tables
        self.tokens[:, :size].copy_(host[:, :size], non_blocking=True)
        self.block_tables[:r].copy_(self._host_tables[:r], non_blocking=True)
        self.num_replays += 1
        if size not in self.graphs:
            return self._forward(size)[:n]
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` tokens of the static buffers, every token a single-token query."""
        input_ids, positions, slots, rows = self.tokens[:, :size]
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=(positions + 1).to(torch.int32),
            block_tables=self.block_tables[rows],
            num_decodes=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            # NOTE: shapes only; what the contexts are is read on the device, never from these host copies.
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            req_of_token=torch.arange(size),
        )
        return self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.monotonic()
        reserved = torch.cuda.memory_reserved()
        pool = None
        for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its memory pool
            self._forward(size)  # compiles this shape's Triton kernels (padding only: nothing is stored)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved  # the captures' pool, for the memory ledger
        logger.info("captured %d CUDA graphs (steps of 1-%d tokens) in %.1f s", len(self.graphs), self.max_num_tokens,
                    time.monotonic() - started)
