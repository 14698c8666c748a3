"""Rotary position embedding with the same inverse frequencies and cos/sin arithmetic as transformers.

NOTE: the cos/sin table is computed once for every position up to ``max_position`` with the same fp32
``position * inv_freq`` product transformers computes per call, so indexing the table is bit-identical to it.
"""

from __future__ import annotations

from types import ModuleType

import torch
from transformers import PretrainedConfig


def rope_parameters(config: PretrainedConfig) -> dict:
    """The RoPE settings of ``config`` in transformers 5's shape (``rope_parameters``), also from 4.x configs."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def inv_freq_and_scaling(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the cos/sin scale. A GGUF file's ``rope_freqs`` (Llama 3.1's long-context
    factors, in the config as ``rope_freq_factors``: ``model_loader.gguf_metadata_folder``) divide the frequencies,
    as llama.cpp applies them."""
    factors = getattr(config, "rope_freq_factors", None)
    inv_freq, scaling = _inv_freq_and_scaling(config, head_dim)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
    return inv_freq, scaling


def _inv_freq_and_scaling(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling changes with the sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin tables in fp32 whatever the model's dtype (a backend may round them to it)."""

    ops: ModuleType | None = None  # kernels.cpu or kernels.fused_ops, when the model runs on them

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = inv_freq_and_scaling(config, head_dim)
        positions = torch.arange(max_position, dtype=torch.float)  # on the default device, the model's
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops:  # in place, straight into the fused qkv rows
            self.ops.rotary_(q, positions, self.cos_cache, self.sin_cache)
            self.ops.rotary_(k, positions, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
