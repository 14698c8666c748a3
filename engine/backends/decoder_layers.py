"""A packed model described for the one-call C decoder (``kernels/cpu/decoder.py``): each layer's panels, norms
and biases as ``LayerWeights`` holds them, read from the modules the CPU backend packed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.backends.packed_linear import SplitLinear
from kernels.cpu.bodies import Body
from kernels.cpu.decoder import Decoder, DecoderShape, LayerWeights

if TYPE_CHECKING:
    from engine.models.linear import Linear
    from engine.models.llama import LlamaForCausalLM


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


def decoder_of(model: LlamaForCausalLM, int8_activations: bool, body: Body, wide: bool = False) -> Decoder:
    """The model's packed layers, described for the one-call C decoder, every product through ``body``: over their
    fp32 panels where ``wide`` (``fp32_panels.py``)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    shape = DecoderShape(
        hidden=model.config.hidden_size, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, intermediate=mlp.intermediate_size, eps=model.norm.eps, scale=attn.attn.scale,
    )
    layers = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(LayerWeights(
            input_norm=_detached(layer.input_layernorm.weight), **_fused("qkv", a.qkv_proj, wide),
            o=_packed(a.o_proj, wide)[""], post_norm=_detached(layer.post_attention_layernorm.weight),
            **_fused("gate_up", m.gate_up_proj, wide), down=_packed(m.down_proj, wide)[""],
            qkv_bias=_detached(a.qkv_proj.bias), o_bias=_detached(a.o_proj.bias),
            gate_up_bias=_detached(m.gate_up_proj.bias), down_bias=_detached(m.down_proj.bias),
            q_norm=_detached(a.q_norm and a.q_norm.weight), k_norm=_detached(a.k_norm and a.k_norm.weight),
        ))
    return Decoder(shape, layers, _detached(model.norm.weight), model.rotary.cos_cache, model.rotary.sin_cache,
                   int8_activations, body)
