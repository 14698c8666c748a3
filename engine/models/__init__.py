"""The model registry: a checkpoint's ``architectures`` name to the class that builds it and its variant.

Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 share one decoder (``llama.py``) and differ in the flags of their
``DecoderVariant``; Qwen3-MoE, Qwen2-MoE and Mixtral are the same decoder with mixture-of-experts layers
(``moe.py``). A new family is one entry here (and, where its layers differ, one model file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from engine.models.llama import (
    AttentionFactory,
    DecoderVariant,
    LlamaForCausalLM,
    llama_variant,
    qwen2_variant,
    qwen3_variant,
)
from engine.models.moe import SparseMoeBlock, checkpoint_names, mixtral_moe, qwen_moe

if TYPE_CHECKING:
    from engine.backends.base import TorchBackend
    from engine.model_loader import ModelFiles
    from engine.tensor_parallel import AllReduce, Shard


@dataclass(frozen=True)
class Architecture:
    model_class: type[LlamaForCausalLM]
    variant: Callable[[PretrainedConfig], DecoderVariant]


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, llama_variant),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, llama_variant),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qwen2_variant),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, qwen3_variant),
    "Qwen2MoeForCausalLM": Architecture(
        LlamaForCausalLM, lambda c: replace(qwen2_variant(c), moe=qwen_moe(c, shared=True))),
    "Qwen3MoeForCausalLM": Architecture(
        LlamaForCausalLM, lambda c: replace(qwen3_variant(c), moe=qwen_moe(c, shared=False))),
    "MixtralForCausalLM": Architecture(LlamaForCausalLM, lambda c: replace(llama_variant(c), moe=mixtral_moe(c))),
    # base models without an LM head, as embedding checkpoints name them (engine/pooling.py)
    "LlamaModel": Architecture(LlamaForCausalLM, llama_variant),
    "MistralModel": Architecture(LlamaForCausalLM, llama_variant),
    "Qwen2Model": Architecture(LlamaForCausalLM, qwen2_variant),
    "Qwen3Model": Architecture(LlamaForCausalLM, qwen3_variant),
}


def build_model(config: PretrainedConfig, max_position: int, make_attention: AttentionFactory,
                pooling: bool = False) -> LlamaForCausalLM:
    """The model ``config`` describes, with random weights (load them next), on the default device; ``pooling``: an
    embedding model's (its hidden states are the output)."""
    name = (config.architectures or ["LlamaForCausalLM"])[0]
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return arch.model_class(config, arch.variant(config), max_position, make_attention, pooling)


def load_model(files: ModelFiles, config: PretrainedConfig, max_position: int, backend: TorchBackend,
               device: torch.device, dtype: torch.dtype, shard: Shard | None = None,
               all_reduce: AllReduce | None = None, pooling: bool = False) -> LlamaForCausalLM:
    """The model of ``files`` (``config``: the whole model's) with its weights in ``dtype`` on ``device`` and packed
    by ``backend``; under tensor parallelism only ``shard``'s part, its input-split projections summed by
    ``all_reduce``. Parameters are made in the dtype, so no fp32 copy of a bf16 checkpoint is ever made."""
    from engine.model_loader import iter_weights

    with torch.device(device), _default_dtype(dtype):
        model = build_model(shard.model_config() if shard else config, max_position, backend.make_attention, pooling)
    # Mixtral's names made Qwen's, and a stacked experts tensor each expert's views, before any shard is cut
    weights = (named for pair in iter_weights(files, config) for named in checkpoint_names(*pair))
    model.load_weights(shard.weights(weights) if shard else weights, lazy=backend.lazy_weights)
    if all_reduce is not None:
        for layer in model.layers:
            layer.self_attn.o_proj.all_reduce = all_reduce
            if isinstance(layer.mlp, SparseMoeBlock):  # one sum of the experts' partial outputs
                layer.mlp.all_reduce = all_reduce
            else:
                layer.mlp.down_proj.all_reduce = all_reduce
    model.eval()
    backend.prepare(model, files.source if shard is None else None)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
