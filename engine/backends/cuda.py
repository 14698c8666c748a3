"""CUDA through Harpoon's Triton kernels (``kernels/``), with small steps replayed from CUDA graphs.

- Attention: K/V stored by slot, decodes by the split-KV decode kernel, prefill chunks by the varlen prefill
  kernel; nothing is gathered into contiguous tensors.
- Norms (with the residual add), rotary and SiLU-mul are one Triton launch each (``kernels/fused_ops.py``) instead of
  ~40 small torch kernels a layer.
- A mixture of experts' chosen experts run as two grouped GEMMs a layer (``kernels/fused_moe.py``).
- Steps of up to 512 tokens replay a graph captured at start-up (``cuda_graphs.py``), unless ``enforce_eager`` (or
  the model is a mixture of experts: its steps run eagerly).
- On a CPU it runs only under the Triton interpreter (``TRITON_INTERPRET=1``, the tests); graphs then run eagerly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata, TorchAttention
from engine.backends.base import TorchBackend
from engine.backends.cuda_graphs import CudaGraphs
from engine.backends.triton_moe import TritonExperts
from engine.models.llama import MLP, RMSNorm
from engine.models.moe import SparseMoeBlock
from engine.models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from pathlib import Path

    from engine.kv_cache import KVCache
    from engine.models.llama import LlamaForCausalLM


class TritonAttention(TorchAttention):
    """Paged attention through the Triton kernels in ``kernels/``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        from kernels.decode_attention import decode_attention  # defines kernels: after TRITON_INTERPRET is set
        from kernels.prefill_attention import prefill_attention
        from kernels.store_kv import store_kv as triton_store_kv

        self._decode_kernel, self._prefill_kernel = decode_attention, prefill_attention
        self.store = triton_store_kv

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor
    ) -> None:
        nd = q.shape[0]
        self._decode_kernel(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale, out=out)

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
        """All prefill chunks in one varlen launch, straight from the pages (k and v are already stored)."""
        nd = meta.num_decodes
        first = meta.query_start_loc_cpu[nd]
        qsl = meta.query_start_loc[nd:] - first
        self._prefill_kernel(q[first:], k_cache, v_cache, meta.block_tables[nd:], qsl, meta.seq_lens[nd:],
                             meta.max_query_len, self.scale, out=out[first:])


class TritonBackend(TorchBackend):
    """Owns the CUDA graphs: the steps that fit replay one, the others run eagerly."""

    name = "triton"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: CudaGraphs | None = None

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for testing)"
        return None

    def check_shapes(self, block_size: int, head_dim: int) -> None:
        from kernels.online_softmax import check_dot_shapes  # defines kernels: after TRITON_INTERPRET is set

        check_dot_shapes(block_size, head_dim, self.device)

    def make_attention(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> TorchAttention:
        return TritonAttention(num_heads, num_kv_heads, head_dim, scale)

    def prepare(self, model: LlamaForCausalLM, weights_file: Path | None = None) -> None:
        from kernels import fused_ops  # defines kernels: after TRITON_INTERPRET is set

        super().prepare(model)  # quantized weights made dense in the model's dtype
        for module in model.modules():
            if isinstance(module, (RMSNorm, MLP, RotaryEmbedding)):
                module.ops = fused_ops
            elif isinstance(module, SparseMoeBlock):  # the chosen experts as two grouped GEMMs
                module.kernel = TritonExperts.stack(module)
        # The fused rotary reads the tables in the model's dtype, as transformers rounds cos and sin to it.
        model.rotary.cos_cache = model.rotary.cos_cache.to(self.dtype)
        model.rotary.sin_cache = model.rotary.sin_cache.to(self.dtype)

    def bind(self, model: LlamaForCausalLM, kv_cache: KVCache, max_num_batched_tokens: int,
             max_model_len: int) -> None:
        # NOTE: under tensor parallelism the steps run eagerly: a captured graph would hold the ranks' collectives. So
        # do a mixture of experts' steps for now: its grouped GEMMs read nothing back to the host (fused_moe.py), but
        # their capture is untried on a GPU.
        if (self.device.type == "cuda" and not self.config.enforce_eager and self.config.tensor_parallel_size == 1
                and not model.sparse):
            self.graphs = CudaGraphs(model, kv_cache, max_num_batched_tokens, self.config.max_num_seqs,
                                     max_model_len, self.device)

    def forward(self, model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(meta):
            return self.graphs.run(input_ids, positions, meta)
        return super().forward(model, input_ids, positions, kv_caches, meta)

    def warm_up_down_to(self, max_model_len: int) -> int | None:
        """Down to the largest step a graph replays: the smaller ones all replay graphs captured at start."""
        return super().warm_up_down_to(max_model_len) if self.graphs is None else self.graphs.max_num_tokens

    def cuda_graph_bytes(self) -> int:
        return 0 if self.graphs is None else self.graphs.pool_bytes

    def describe(self) -> str:
        return "triton backend" + (" with CUDA graphs" if self.graphs is not None else "")
