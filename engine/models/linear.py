"""Layers whose product a backend may replace: a linear layer and a vocabulary embedding.

A backend that packs weights for its own kernels (``engine/backends``) hands each layer a ``kernel`` and frees the
weight's original layout, so the model's weights are held once either way; without one, the layer is plain torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# (x [M, in], bias or None) -> [M, out]: a product over weights a backend packed for its kernels
LinearKernel = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
# token ids [T] -> rows [T, hidden]: lookups a backend reads from its packed weights
EmbeddingKernel = Callable[[torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """``nn.Linear`` whose product a backend can take over (``kernel``)."""

    kernel: LinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def release_weight(self) -> torch.Tensor:
        """The weight, detached, for a backend to pack; the layer keeps only an empty placeholder."""
        weight = self.weight.detach()
        self.weight = nn.Parameter(weight.new_empty(0, self.in_features), requires_grad=False)
        return weight


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` whose lookups a backend can take over (``kernel``), e.g. from an LM head's packed panels."""

    kernel: EmbeddingKernel | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(input_ids)
        return super().forward(input_ids)
