"""The Llama-architecture decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 differ only in the flags below.

The forward takes one flattened batch of tokens from many requests (no padding) and explicit attention
metadata; only the rows that are sampled (or scored for prompt logprobs) go through the LM head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.attention import AttentionMetadata, TorchAttention
from engine.models.linear import Linear, VocabEmbedding
from engine.models.moe import MoeVariant, SparseMoeBlock
from engine.models.quantized import Blocks, stack
from engine.models.rotary import RotaryEmbedding

# (num_heads, num_kv_heads, head_dim, scale) -> the attention a backend runs over the paged pool
AttentionFactory = Callable[[int, int, int, float], TorchAttention]


@dataclass(frozen=True)
class DecoderVariant:
    """Where the family members differ."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    moe: MoeVariant | None = None  # mixture-of-experts layers in place of (some) dense MLPs (moe.py)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def llama_variant(config: PretrainedConfig) -> DecoderVariant:
    """Llama 2/3, SmolLM2, Mistral: biases only where the config asks for them."""
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


def qwen2_variant(config: PretrainedConfig) -> DecoderVariant:
    return DecoderVariant(qkv_bias=True)


def qwen3_variant(config: PretrainedConfig) -> DecoderVariant:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderVariant(qkv_bias=bias, o_bias=bias, qk_norm=True)


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it (``norm(x, residual)`` adds x into residual)."""

    ops: ModuleType | None = None  # a backend's fused kernels (rms_norm, add_rms_norm), set by the backend

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps) if self.ops else self._norm(x)
        if self.ops:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers, so fp32 results are bit-identical.
        input_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class Attention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, variant: DecoderVariant, rotary: RotaryEmbedding,
        make_attention: AttentionFactory,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = num_kv_heads_of(config)
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=variant.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=variant.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.rotary = rotary
        self.attn = make_attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU: a dense layer's MLP, and each expert of a mixture-of-experts layer."""

    ops: ModuleType | None = None  # a backend's fused kernels (silu_mul), set by the backend

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant, intermediate_size: int | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=variant.mlp_bias)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=variant.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, variant: DecoderVariant, rotary: RotaryEmbedding,
        make_attention: AttentionFactory, index: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, variant, rotary, make_attention)
        moe = variant.moe
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(config.hidden_size, moe, lambda width: MLP(config, variant, width))
            if moe is not None and moe.is_sparse(index) else MLP(config, variant))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's MLP output and the residual stream before it (added in by the next norm)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# HF checkpoint name -> (our fused parameter, which shard). Order of shards inside the fused weight follows the list.
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (sharing the embeddings' weight when the config ties them).
    Pure layers: which kernels run them is the backend's business (``engine/backends``)."""

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant, max_position: int,
                 make_attention: AttentionFactory, pooling: bool = False) -> None:
        """``pooling``: an embedding model's, whose hidden states are the output: the LM head is a one-row stand-in
        (a checkpoint may have none; a packed copy of the vocabulary's would be memory for nothing)."""
        super().__init__()
        self.config = config
        self.pooling = pooling
        # where and in what dtype the weights are made when loaded (they start on the meta device: linear.py)
        self.weight_device, self.weight_dtype = torch.get_default_device(), torch.get_default_dtype()
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, variant, self.rotary, make_attention, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and not pooling
        self.lm_head = Linear(config.hidden_size, 1 if pooling else config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def sparse(self) -> bool:
        """Whether any layer is a mixture of experts (whose experts a step chooses: no CUDA graph captures it)."""
        return any(isinstance(layer.mlp, SparseMoeBlock) for layer in self.layers)

    def first_mlp(self) -> MLP:
        """The first SwiGLU MLP: a dense layer's, or else the first expert's (the projections start-up times)."""
        return next(m for m in self.modules() if isinstance(m, MLP))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: (k, v) pools
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | Blocks]], lazy: bool = False) -> None:
        """Copy a transformers checkpoint's tensors in, fusing q/k/v and gate/up. Fails on anything missing.
        A GGUF file's blocks (``FileBlocks``, or a decoded ``QuantizedWeight``) are kept as the layer's ``quantized``,
        the shards of a fused layer stacked once all have come. ``lazy`` (the weights on the CPU): a linear layer's
        tensors are kept as they come, views of the checkpoint's mappings, as its ``parts``, and an embedding table
        in the weights' dtype is taken as it is: nothing is read until a backend packs them."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        pending: dict[str, dict[int, Blocks | torch.Tensor]] = {}  # fused layer -> its quantized or lazy shards so far
        loaded: set[str] = set()
        lazy = lazy and self.weight_device.type == "cpu"
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or ((self.tie_word_embeddings or self.pooling) and name == "lm_head.weight"):
                continue
            parts = name.split(".")
            fused = _STACKED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                target, shard = fused
                name = ".".join([*parts[:-2], target, parts[-1]])
                loaded.add(f"{name}#{shard}")
                kept = lazy and name.endswith(".weight")
                if kept or not isinstance(tensor, torch.Tensor):
                    shards = pending.setdefault(name, {})
                    shards[shard] = tensor
                    if len(shards) == {"qkv_proj": 3, "gate_up_proj": 2}[target]:
                        ordered = [shards[i] for i in sorted(shards)]
                        dense = {isinstance(t, torch.Tensor) for t in ordered}
                        if dense == {True}:
                            self._keep_parts(params, name, ordered)
                        elif dense == {False}:
                            modules[name.rpartition(".")[0]].quantized = stack(ordered)
                        if len(dense) == 1:  # else left pending: refused below
                            del pending[name]
                    continue
                offset = self._shard_offset(modules[name.rpartition(".")[0]], target, shard)
                self._materialized(params, name).data[offset : offset + tensor.shape[0]].copy_(tensor)
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            module = modules[name.rpartition(".")[0]]
            if not isinstance(tensor, torch.Tensor):
                module.quantized = tensor
            elif lazy and isinstance(module, Linear) and name.endswith(".weight"):
                self._keep_parts(params, name, [tensor])
            elif (lazy and isinstance(module, VocabEmbedding) and tensor.dtype == self.weight_dtype
                  and tensor.is_contiguous() and tensor.shape == params[name].shape):
                self._materialized(params, name, tensor)
            else:
                self._materialized(params, name).data.copy_(tensor)
            loaded.add(name)
        if pending:
            raise ValueError(f"checkpoint mixes quantized and dense shards of {sorted(pending)[:3]}")
        if self.tie_word_embeddings:
            self.lm_head.quantized = self.embed_tokens.quantized
        if self.pooling:
            self._materialized(params, "lm_head.weight").data.zero_()
            loaded.add("lm_head.weight")
        expected = set()
        for name in params:
            target = name.split(".")[-2]
            shards = {"qkv_proj": 3, "gate_up_proj": 2}.get(target)
            expected |= {f"{name}#{i}" for i in range(shards)} if shards else {name}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")

    def _materialized(self, params: dict[str, nn.Parameter], name: str,
                      storage: torch.Tensor | None = None) -> nn.Parameter:
        """Parameter ``name`` with storage of its own: made (uninitialized, or ``storage`` itself) on its first write
        if it is still on the meta device, and set wherever it is shared (a tied LM head)."""
        param = params[name]
        if not param.is_meta:
            return param
        if storage is None:
            storage = torch.empty(param.shape, dtype=self.weight_dtype, device=self.weight_device)
        made = nn.Parameter(storage, requires_grad=False)
        for module in self.modules():
            for attr, value in list(module._parameters.items()):
                if value is param:
                    setattr(module, attr, made)
        params[name] = made
        return made

    def _keep_parts(self, params: dict[str, nn.Parameter], name: str, parts: list[torch.Tensor]) -> None:
        """A linear layer's weight left on the meta device, its checkpoint tensors kept as its ``parts``."""
        module, shape = self.get_submodule(name.rpartition(".")[0]), params[name].shape
        rows = sum(p.shape[0] for p in parts)
        if any(p.dim() != 2 or p.shape[1] != shape[1] for p in parts) or rows != shape[0]:
            raise ValueError(f"checkpoint tensors of {name} are {[list(p.shape) for p in parts]}, "
                             f"not the {list(shape)} the config makes")
        module.parts = parts

    def _shard_offset(self, module: Linear, target: str, shard: int) -> int:
        attn = self.layers[0].self_attn
        if target == "qkv_proj":
            return [0, attn.q_size, attn.q_size + attn.kv_size][shard]
        return shard * module.out_features // 2
