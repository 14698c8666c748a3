"""A mixture-of-experts block's experts on a GPU: its experts' weights stacked once into [E, 2I, H] and [E, H, I]
(each expert's own tensors then let go), and a step's chosen experts run as two grouped GEMMs
(``kernels/fused_moe.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.moe import SparseMoeBlock


@dataclass(frozen=True)
class TritonExperts:
    """``SparseMoeBlock.kernel`` on the Triton backend: the routed experts fused, the shared expert (Qwen2-MoE)
    through its modules."""

    w13: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor  # [E, H, I]
    block: SparseMoeBlock

    @classmethod
    def stack(cls, block: SparseMoeBlock) -> TritonExperts:
        """The block's experts' weights stacked (one copy at a time: each expert's is freed as it is copied)."""
        first = block.experts[0]
        w13 = first.gate_up_proj.weight.new_empty(len(block.experts), *first.gate_up_proj.weight.shape)
        w2 = first.down_proj.weight.new_empty(len(block.experts), *first.down_proj.weight.shape)
        for e, expert in enumerate(block.experts):
            if expert.gate_up_proj.bias is not None or expert.down_proj.bias is not None:
                raise ValueError("experts with biases are not fused")
            w13[e].copy_(expert.gate_up_proj.dense_weight())
            w2[e].copy_(expert.down_proj.dense_weight())
            expert.gate_up_proj.drop_weight()
            expert.down_proj.drop_weight()
        return cls(w13, w2, block)

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from kernels.fused_moe import fused_experts  # defines kernels: after TRITON_INTERPRET is set

        return self.block.with_shared(fused_experts(x.contiguous(), self.w13, self.w2, experts, weights), x)
