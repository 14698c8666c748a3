"""The mixture-of-experts layer: a router picks k of E experts per token, and the token's MLP output is their
weighted sum (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral).

Each expert is an ``MLP`` of its own (``gate_up_proj``, ``down_proj``), so a backend packs and runs it as any dense
layer's MLP: a GGUF file's expert blocks stay in their quantized blocks, one expert's rows at a time, and a step
runs only the experts its tokens chose, each over just its tokens. Where the families differ is data
(``MoeVariant``): how the router turns logits into weights, which layers are sparse, and whether a shared expert
runs beside the routed ones. gpt-oss (top-k before a softmax, router bias, clamped SwiGLU) and Qwen3.5-MoE add
their router and activation here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.models.linear import Linear


@dataclass(frozen=True)
class MoeVariant:
    """A family's experts: how many, how they are routed, and where."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the k chosen weights renormalised to sum to 1
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none), scaled by sigmoid(shared_expert_gate)
    sparse_step: int = 1  # every sparse_step-th layer is sparse (Qwen's decoder_sparse_step) ...
    dense_layers: tuple[int, ...] = ()  # ... but these, which keep a dense MLP (Qwen's mlp_only_layers)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


def num_experts_of(config: PretrainedConfig) -> int:
    """E: transformers 5 keeps Qwen's ``num_experts`` as ``num_local_experts`` (a plain config has no alias)."""
    return getattr(config, "num_local_experts", None) or config.num_experts


def qwen_moe(config: PretrainedConfig, shared: bool) -> MoeVariant:
    return MoeVariant(
        num_experts=num_experts_of(config), top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
        shared_intermediate_size=config.shared_expert_intermediate_size if shared else 0,
        sparse_step=config.decoder_sparse_step, dense_layers=tuple(config.mlp_only_layers or ()),
    )


def mixtral_moe(config: PretrainedConfig) -> MoeVariant:
    return MoeVariant(num_experts=num_experts_of(config), top_k=config.num_experts_per_tok,
                      intermediate_size=config.intermediate_size, norm_topk_prob=True)


def route(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, as transformers computes it: (weights [T, k] in the logits' dtype, experts [T, k]).
    Ties go as ``torch.topk`` breaks them, so the same experts are chosen as the reference's."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert, in place of a dense layer's MLP."""

    # a tensor-parallel rank's experts hold a slice of each expert's columns: the block's output is a partial sum,
    # summed across the ranks once (engine/tensor_parallel.py)
    all_reduce: Callable[[torch.Tensor], None] | None = None
    # (x, experts [T, k], weights [T, k]) -> the chosen experts' weighted sum plus the gated shared expert, as a
    # backend runs them at once (the CPU's C block, packed_moe.py; a GPU's grouped GEMMs, triton_moe.py); None: the
    # modules below, an expert a call
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, hidden_size: int, moe: MoeVariant, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.num_experts = moe.top_k, moe.norm_topk_prob, moe.num_experts
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(make_mlp(moe.intermediate_size) for _ in range(moe.num_experts))
        self.shared_expert = make_mlp(moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if self.shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        if self.kernel is not None:
            out = self.kernel(x, experts, weights)
        else:
            out = self.with_shared(self.run_experts(x, experts, weights), x)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out

    def with_shared(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' ``out`` plus the shared expert's output scaled by sigmoid(shared_expert_gate(x)),
        where the block has one (Qwen2-MoE)."""
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once, over just the tokens that chose it, in ascending expert order (transformers'
        order, so fp32 sums are added as the reference adds them); a step reads at most min(E, T k) experts."""
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights, start = weights.flatten(), 0
        for e, n in enumerate(counts):
            if not n:
                continue
            chosen, start = order[start:start + n], start + n
            tokens = chosen // self.top_k
            y = self.experts[e](x[tokens]) * flat_weights[chosen, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


def per_token(module: nn.Module, measure: Callable[[Linear], int]) -> int:
    """``measure`` summed over the linear layers one token runs through ``module``: every layer's, but of a mixture
    of experts only top_k experts' (of their average), as many as a token runs."""
    total, experts = 0, set()
    for block in module.modules():
        if isinstance(block, SparseMoeBlock):
            mine = [m for e in block.experts for m in e.modules() if isinstance(m, nn.Linear)]
            total += sum(map(measure, mine)) * block.top_k // len(block.experts)
            experts |= {id(m) for m in mine}
    return total + sum(measure(m) for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in experts)


def token_flops(layers: nn.Module) -> int:
    """GEMM FLOPs of one token through ``layers`` (``per_token``)."""
    return per_token(layers, lambda m: 2 * m.in_features * m.out_features)


# Mixtral's checkpoint names -> ours (the layout Qwen's MoE checkpoints already use)
_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def checkpoint_names(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's MoE tensor under the names ``load_weights`` takes: Mixtral's renamed, and an experts tensor
    stacked over the experts (transformers' own ``mlp.experts.gate_up_proj`` [E, 2I, H] or ``down_proj``
    [E, H, I]) as each expert's views (nothing copied)."""
    parts = name.split(".")
    if "block_sparse_moe" in parts:
        parts = [_MIXTRAL_NAMES.get(p, p) for p in parts]
        name = ".".join(parts)
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in ("gate_up_proj", "down_proj") \
            and isinstance(tensor, torch.Tensor) and tensor.dim() == 3:
        head = ".".join(parts[:-1])
        if parts[-1] == "down_proj":
            return [(f"{head}.{e}.down_proj.weight", t) for e, t in enumerate(tensor.unbind(0))]
        named = []
        for e, t in enumerate(tensor.unbind(0)):
            gate, up = t.chunk(2, dim=0)
            named += [(f"{head}.{e}.gate_proj.weight", gate), (f"{head}.{e}.up_proj.weight", up)]
        return named
    return [(name, tensor)]
