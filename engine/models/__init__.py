"""The model registry: a checkpoint's ``architectures`` name to the class that builds it and its variant.

Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 share one decoder (``llama.py``) and differ in the flags of their
``DecoderVariant``. A new family is one entry here (and, where its layers differ, one model file).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from engine.models.llama import (
    AttentionFactory,
    DecoderVariant,
    LlamaForCausalLM,
    llama_variant,
    qwen2_variant,
    qwen3_variant,
)


@dataclass(frozen=True)
class Architecture:
    model_class: type[LlamaForCausalLM]
    variant: Callable[[PretrainedConfig], DecoderVariant]


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, llama_variant),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, llama_variant),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qwen2_variant),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, qwen3_variant),
}


def build_model(config: PretrainedConfig, max_position: int, make_attention: AttentionFactory) -> LlamaForCausalLM:
    """The model ``config`` describes, with random weights (load them next), on the default device."""
    name = (config.architectures or ["LlamaForCausalLM"])[0]
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return arch.model_class(config, arch.variant(config), max_position, make_attention)
