"""A mixture-of-experts block's packed experts in one C call (``kernels/cpu/moe.py``), made from the kernels the CPU
backend set on its modules: the block's ``kernel`` on the module path, and its part of the one-call decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.packed_linear import PackedLinear
from engine.models.linear import Linear
from engine.models.moe import SparseMoeBlock, per_token
from kernels.cpu.moe import MoeBlock, MoeWeights, Product


def _product(layer: Linear) -> Product | None:
    kernel = layer.kernel
    return (kernel.packed, kernel.word) if isinstance(kernel, PackedLinear) and layer.bias is None else None


def moe_block_of(block: SparseMoeBlock, split: bool = False) -> MoeBlock | None:
    """The block's experts for one C call; None where a product is not one PackedLinear without a bias (a fused
    projection held in two formats, a oneDNN product), which the modules then run one call at a time."""
    gate_up = [_product(e.gate_up_proj) for e in block.experts]
    down = [_product(e.down_proj) for e in block.experts]
    shared = block.shared_expert
    parts = [_product(block.gate), *gate_up, *down]
    if shared is not None:
        parts += [_product(shared.gate_up_proj), _product(shared.down_proj), _product(block.shared_expert_gate)]
    if any(p is None for p in parts):
        return None
    return MoeBlock(MoeWeights(
        router=parts[0], gate_up=gate_up, down=down, top_k=block.top_k, norm_topk=block.norm_topk_prob,
        intermediate=block.experts[0].intermediate_size,
        shared_gate_up=parts[-3] if shared else None, shared_down=parts[-2] if shared else None,
        shared_gate=parts[-1] if shared else None, shared_intermediate=shared.intermediate_size if shared else 0,
    ), split)


def _bytes(layer: Linear) -> int:
    parts = getattr(layer.kernel, "parts", ())
    return sum(part.packed.nbytes for part in parts) if parts else layer.weight.nbytes


def token_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of packed weights one token reads through the layers and the LM head (``per_token``)."""
    return per_token(model, _bytes)


@dataclass(frozen=True)
class PackedExperts:
    """``SparseMoeBlock.kernel``: the chosen experts (and the shared one) of a step in one C call."""

    block: MoeBlock

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.block.experts(x.contiguous(), experts, weights)
