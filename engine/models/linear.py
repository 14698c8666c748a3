"""Layers whose product a backend may replace: a linear layer and a vocabulary embedding.

A backend that packs weights for its own kernels (``engine/backends``) hands each layer a ``kernel`` and frees the
weight's original layout, so the model's weights are held once either way; without one, the layer is plain torch.

Their weights start on the meta device: they are always loaded next (``LlamaForCausalLM.load_weights``), either into
a tensor made then or as a GGUF file's blocks (``Blocks``) that leave ``weight`` empty, so no random initialization
is spent and no dense weight is ever made for a quantized one. For a backend that packs every weight
(``TorchBackend.lazy_weights``), a checkpoint's dense weights stay views of its files' mappings (``parts``) until
packed: where the panels are cached, they are never read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.quantized import Blocks

# (x [M, in], bias or None) -> [M, out]: a product over weights a backend packed for its kernels
LinearKernel = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
# token ids [T] -> rows [T, hidden]: lookups a backend reads from its packed weights
EmbeddingKernel = Callable[[torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """``nn.Linear`` whose product a backend can take over (``kernel``), its weight dense or ``quantized``."""

    kernel: LinearKernel | None = None
    quantized: Blocks | None = None  # a GGUF file's blocks, until a backend packs or dequantizes them
    # A tensor-parallel rank's input-split projection (engine/tensor_parallel.py): its product is a partial sum,
    # summed in place across the ranks before the bias is added once.
    all_reduce: Callable[[torch.Tensor], None] | None = None
    # A checkpoint's tensors of this weight (q, k and v of a fused one, in order), views of the files' mappings, while
    # ``weight`` waits on the meta device. Why: an 8B bfloat16 checkpoint's 15 GiB were copied into the weights at
    # every start and then packed, or dropped where the panel cache held the panels
    # (docs/history/benchmarks-2026-12.md).
    parts: list[torch.Tensor] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            out = self.kernel(x, None) if self.kernel is not None else F.linear(x, self.weight)
            self.all_reduce(out)
            return out if self.bias is None else out + self.bias
        if self.kernel is not None:
            return self.kernel(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight, detached, in its dtype: stacked from its ``parts`` where they wait (read again at each call)."""
        if self.parts is None:
            return self.weight.detach()
        parts = [p.to(self.weight.dtype) for p in self.parts]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

    def release_weight(self) -> torch.Tensor:
        """The weight, detached, for a backend to pack; the layer keeps only an empty placeholder."""
        weight = self.dense_weight()
        self.drop_weight()
        return weight

    def drop_weight(self) -> None:
        """The weight let go (a backend holds its panels), read or not; an empty placeholder in its place."""
        device = "cpu" if self.weight.is_meta else self.weight.device
        self.parts = None
        self.weight = nn.Parameter(torch.empty(0, self.in_features, dtype=self.weight.dtype, device=device),
                                   requires_grad=False)

    def take_quantized(self) -> Blocks:
        """The quantized weight, for a backend to pack; the layer keeps only an empty placeholder."""
        weight, self.quantized = self.quantized, None
        self.weight = nn.Parameter(torch.empty(0, self.in_features, dtype=self.weight.dtype), requires_grad=False)
        return weight


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` whose lookups a backend can take over (``kernel``), e.g. from an LM head's packed panels."""

    kernel: EmbeddingKernel | None = None
    quantized: Blocks | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        # Given its (meta) weight, nn.Embedding skips its random init: on meta tensors that init imported torch's
        # dynamo, 0.7 s of every start.
        weight = torch.empty(num_embeddings, embedding_dim, device="meta")
        super().__init__(num_embeddings, embedding_dim, _weight=weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(input_ids)
        return super().forward(input_ids)


def dequantize_weights(model: nn.Module, dtype: torch.dtype, device: torch.device,
                       keep: tuple[nn.Module, ...] = ()) -> None:
    """Every quantized layer's weight (but ``keep``'s) made dense in ``dtype`` on ``device``, for kernels that take
    dense weights (a GPU's, or bfloat16 products on a CPU): the documented fallback, at the dense weight's memory. A
    weight two layers share (a tied LM head) stays shared."""
    dense: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, (Linear, VocabEmbedding)) and module.quantized is not None and module not in keep:
            key = id(module.quantized)
            if key not in dense:
                dense[key] = nn.Parameter(module.quantized.dequantize(dtype).to(device), requires_grad=False)
            module.weight, module.quantized = dense[key], None
