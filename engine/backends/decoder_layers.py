"""A packed model described for the one-call C decoder (``kernels/cpu/decoder.py``): each layer's panels, norms
and biases as ``LayerWeights`` holds them, read from the modules the CPU backend packed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.backends.packed_linear import SplitLinear
from engine.models.moe import SparseMoeBlock
from kernels.cpu.bodies import Body
from kernels.cpu.decoder import Decoder, DecoderShape, LayerWeights

if TYPE_CHECKING:
    from engine.models.linear import Linear
    from engine.models.llama import MLP, LlamaForCausalLM


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _packed(layer: Linear, wide: bool) -> dict[str, torch.Tensor | int | None]:
    """A projection's panels as ``LayerWeights`` holds them: whole, or a head and a tail (``SplitLinear``); its
    fp32 panels where ``wide`` and it has them."""
    panels = [part.read(wide) for part in layer.kernel.parts]
    if isinstance(layer.kernel, SplitLinear):
        return {"": panels[0], "_tail": panels[1], "_head_rows": layer.kernel.head.out_features}
    return {"": panels[0]}


def _fused(name: str, layer: Linear, wide: bool) -> dict[str, torch.Tensor | int]:
    return {name + suffix: value for suffix, value in _packed(layer, wide).items()}


def _mlp(layer: MLP | SparseMoeBlock, wide: bool) -> dict[str, object]:
    """A dense layer's gate_up and down, or a mixture of experts' block (the one its ``kernel`` runs)."""
    if isinstance(layer, SparseMoeBlock):
        return {"gate_up": None, "down": None, "moe": layer.kernel.block}
    return {**_fused("gate_up", layer.gate_up_proj, wide), "down": _packed(layer.down_proj, wide)[""],
            "gate_up_bias": _detached(layer.gate_up_proj.bias), "down_bias": _detached(layer.down_proj.bias)}


def decoder_of(model: LlamaForCausalLM, int8_activations: bool, body: Body, wide: bool = False) -> Decoder | None:
    """The model's packed layers, described for the one-call C decoder, every product through ``body``: over their
    fp32 panels where ``wide`` (``fp32_panels.py``). None where a mixture-of-experts block has no one-call kernel."""
    if any(isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.kernel is None for layer in model.layers):
        return None
    attn = model.layers[0].self_attn
    shape = DecoderShape(
        hidden=model.config.hidden_size, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, intermediate=model.config.intermediate_size, eps=model.norm.eps,
        scale=attn.attn.scale,
    )
    layers = []
    for layer in model.layers:
        a = layer.self_attn
        layers.append(LayerWeights(
            input_norm=_detached(layer.input_layernorm.weight), **_fused("qkv", a.qkv_proj, wide),
            o=_packed(a.o_proj, wide)[""], post_norm=_detached(layer.post_attention_layernorm.weight),
            **_mlp(layer.mlp, wide), qkv_bias=_detached(a.qkv_proj.bias), o_bias=_detached(a.o_proj.bias),
            q_norm=_detached(a.q_norm and a.q_norm.weight), k_norm=_detached(a.k_norm and a.k_norm.weight),
        ))
    return Decoder(shape, layers, _detached(model.norm.weight), model.rotary.cos_cache, model.rotary.sin_cache,
                   int8_activations, body)
