"""The Llama-architecture decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 differ only in the flags below.

The forward takes one flattened batch of tokens from many requests (no padding) and explicit attention
metadata; only the rows that are sampled (or scored for prompt logprobs) go through the LM head.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.attention import AttentionMetadata, make_attention
from engine.models.greedy_head import ScreenedGreedyHead, pack_head
from engine.models.linear import Linear, linear
from engine.models.rotary import RotaryEmbedding
from kernels import cpu as cpu_kernels
from kernels.cpu.decoder import Decoder, DecoderShape, LayerWeights


@dataclass(frozen=True)
class DecoderVariant:
    """Where the family members differ."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def variant_for(config: PretrainedConfig) -> DecoderVariant:
    arch = (config.architectures or ["LlamaForCausalLM"])[0]
    attention_bias = bool(getattr(config, "attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        return DecoderVariant(qkv_bias=True)
    if arch == "Qwen3ForCausalLM":
        return DecoderVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    if arch in ("LlamaForCausalLM", "MistralForCausalLM"):
        return DecoderVariant(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )
    raise ValueError(f"unsupported architecture {arch!r}; supported: Llama, Mistral, Qwen2, Qwen3")


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it (``norm(x, residual)`` adds x into residual)."""

    ops: ModuleType | None = None  # kernels.cpu or kernels.fused_ops, when the model runs on them

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
        self, config: PretrainedConfig, variant: DecoderVariant, rotary: RotaryEmbedding, backend: str
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
        self.attn = make_attention(backend, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

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
    ops: ModuleType | None = None  # kernels.cpu or kernels.fused_ops, when the model runs on them

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=variant.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=variant.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, variant: DecoderVariant, rotary: RotaryEmbedding, backend: str
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, variant, rotary, backend)
        self.mlp = MLP(config, variant)
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


# NOTE: the C decoder attends each prompt token separately, reading its whole prefix (the flash kernel of torch's
# SDPA reuses each K/V row across a tile of queries), so its attention grows with chunk x context. Up to 64-token
# chunks, as decode steps carry them, the one call is faster than the modules plus SDPA whatever the context. So
# are chunks of any length while their context stays within 1024 positions: a 128-token prompt beside 64 decodes
# took 340 ms instead of 391, alone 205 instead of 218; a 1024-token prompt 2.16 s instead of 2.26. A 2048-token
# prompt took 5.68 s instead of 5.40 through the C decoder alone; its chunks past 1024 positions keep the modules.
CPU_DECODER_MAX_QUERY_LEN = 64
CPU_DECODER_MAX_PREFILL_CONTEXT = 1024

# HF checkpoint name -> (our fused parameter, which shard). Order of shards inside the fused weight follows the list.
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings when the config says so)."""

    def __init__(self, config: PretrainedConfig, max_position: int, attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        variant = variant_for(config)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, variant, self.rotary, attention_backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.packed_tied_head: torch.Tensor | None = None  # the embeddings packed for the C kernels' LM head
        self.packed_embed: torch.Tensor | None = None  # the panels the lookups read, once the fp32 table is freed
        self.cpu_decoder: Decoder | None = None  # all layers in one C call, for decodes and short prefill chunks
        self.greedy_head: ScreenedGreedyHead | None = None  # greedy tokens without the full fp32 logits
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: (k, v) pools
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x, residual = self.embed(input_ids), None
        if self.cpu_decoder is not None and (
            meta.max_query_len <= CPU_DECODER_MAX_QUERY_LEN
            or meta.max_prefill_seq_len <= CPU_DECODER_MAX_PREFILL_CONTEXT
        ):
            return self._cpu_decoder_forward(x, positions, kv_caches, meta)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden_size]
        if self.packed_embed is None:
            return self.embed_tokens(input_ids)
        return cpu_kernels.embed_rows(self.packed_embed, input_ids, self.config.vocab_size)

    def _cpu_decoder_forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Every token as its own paged-attention query: a prompt token at position p attends positions 0..p of
        its request (stored before any attention runs), which is causal attention over the chunk and its prefix."""
        if meta.num_decodes == meta.num_reqs:
            tables, seq_lens = meta.block_tables, meta.seq_lens
        else:
            tables = meta.block_tables[meta.req_of_token]
            seq_lens = (positions + 1).to(torch.int32)
        return self.cpu_decoder(x, positions, meta.slot_mapping, tables, seq_lens, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_tied_head is not None:
            return cpu_kernels.linear(hidden, self.packed_tied_head, self.config.vocab_size)
        return linear(hidden, self.embed_tokens.weight).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).argmax(-1)``, the same tokens, without computing the full logits where the C
        kernels' screened head can (small batches); None where the caller must compute the logits."""
        return None if self.greedy_head is None else self.greedy_head.argmax(hidden)

    def _use_ops(self, ops: ModuleType) -> None:
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, RotaryEmbedding)):
                module.ops = ops

    def use_triton_ops(self) -> None:
        """Norms, rotary and activation through ``kernels.fused_ops``: one launch each instead of 5-14 small torch
        kernels (for the Triton attention backend, whose steps are made of launches)."""
        from kernels import fused_ops  # defines kernels: after TRITON_INTERPRET is set

        self._use_ops(fused_ops)

    def use_cpu_kernels(self) -> None:
        """Switches an fp32 CPU model, once its weights are loaded, to the C kernels of ``kernels/cpu``: packed
        weights for every projection and the LM head, fused norms, rotary and activation. The attention backend
        ("cpu") is chosen at construction."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu_kernels(pack_head if module is self.lm_head else cpu_kernels.pack_weight_compact)
        self._use_ops(cpu_kernels)
        # NOTE: the lookups then read the LM head's panels where it is tied (the same values), or the embedding's own
        # Q4/Q8 panels where it has such; either way the fp32 table is freed (113 MB for SmolLM2-135M).
        table = self.embed_tokens.weight.detach()
        if self.lm_head is None:
            self.packed_tied_head = self.packed_embed = pack_head(table)
        else:
            self.packed_embed = cpu_kernels.pack_weight_blocks(table)
        if self.packed_embed is not None:
            self.embed_tokens.weight.data = table.new_empty(0, table.shape[1])
        head = self.packed_tied_head if self.lm_head is None else self.lm_head.packed
        screens = head.dtype == torch.float32 and head.shape[1] % 4 == 0
        if screens and (self.lm_head is None or self.lm_head.bias is None):
            self.greedy_head = ScreenedGreedyHead(head, self.config.vocab_size)
        self.cpu_decoder = self._cpu_decoder()

    def _cpu_decoder(self) -> Decoder:
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        shape = DecoderShape(
            hidden=self.config.hidden_size, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate=mlp.intermediate_size, eps=self.norm.eps, scale=attn.attn.scale,
        )
        layers = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                input_norm=_detached(layer.input_layernorm.weight), qkv=a.qkv_proj.packed, o=a.o_proj.packed,
                post_norm=_detached(layer.post_attention_layernorm.weight), gate_up=m.gate_up_proj.packed,
                down=m.down_proj.packed, qkv_bias=_detached(a.qkv_proj.bias), o_bias=_detached(a.o_proj.bias),
                gate_up_bias=_detached(m.gate_up_proj.bias), down_bias=_detached(m.down_proj.bias),
                q_norm=_detached(a.q_norm and a.q_norm.weight), k_norm=_detached(a.k_norm and a.k_norm.weight),
            ))
        return Decoder(shape, layers, _detached(self.norm.weight), self.rotary.cos_cache, self.rotary.sin_cache)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a transformers checkpoint's tensors in, fusing q/k/v and gate/up. Fails on anything missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            parts = name.split(".")
            fused = _STACKED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                target, shard = fused
                name = ".".join([*parts[:-2], target, parts[-1]])
                param = params[name]
                offset = self._shard_offset(target, shard)
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
                loaded.add(f"{name}#{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            params[name].data.copy_(tensor)
            loaded.add(name)
        expected = set()
        for name in params:
            target = name.split(".")[-2]
            shards = {"qkv_proj": 3, "gate_up_proj": 2}.get(target)
            expected |= {f"{name}#{i}" for i in range(shards)} if shards else {name}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")

    def _shard_offset(self, target: str, shard: int) -> int:
        attn = self.layers[0].self_attn
        if target == "qkv_proj":
            return [0, attn.q_size, attn.q_size + attn.kv_size][shard]
        return shard * self.layers[0].mlp.intermediate_size


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()
