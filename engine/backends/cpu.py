"""fp32 or bfloat16 on a CPU through Harpoon's C kernels (``kernels/cpu``).

What it does with a model (``prepare``):
- bfloat16: every projection and the LM head as BF16C panels, whose products round the activations to bfloat16 and
  sum in fp32 (avx512_bf16's dot product where the CPU has it, FMAs with the same bits elsewhere); everything
  between the products stays fp32. Where the CPU has AMX tiles and they time faster at start-up, every product runs
  on them instead, from BF16A panels (BF16C 32 columns wide: two whole tiles);
- fp32: every projection's weight is packed into panels in the fewest bytes that hold it exactly: Q4, Q8 or BF16
  where the values allow, else fp32 (``pack_weight_compact``); the products are bit for bit those of fp32 panels;
  where those fp32 panels are small beside the memory, they are kept too, and products of as many rows as start-up
  timed them faster from read them instead (``fp32_panels.py``);
- the LM head is packed the same way, and the token lookups read its panels when it is tied, so no row-major table
  is kept beside them;
- a GGUF file's blocks are packed as they are, or mapped from a cache file of the panels an earlier start packed
  (``panel_cache.py``);
- norms, rotary and SiLU-mul run as fused C kernels;
- steps of short queries, or of prompt chunks within ``DECODER_MAX_PREFILL_CONTEXT`` positions, run every layer
  in one C call (``kernels/cpu/decoder.py``); other steps go through the model's modules and torch's flash SDPA;
- greedy steps of up to 8 rows take their tokens from a screened int8 copy of an fp32 LM head (``greedy_head.py``);
  an exact head of Q8 panels (a GGUF file's Q8_0, as the default model's) is screened by its own int8-activation
  product, for the batch sizes at which start-up timed that faster; either way the tokens are the exact head's.
  Where AMX computes the LM head, greedy steps take each row's argmax as the tiles produce the logits, which are
  never written (``argmax_linear``: the same products, so the same tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata, TorchAttention
from engine.backends import amx_blocks, fp32_panels
from engine.backends.base import TorchBackend
from engine.backends.cpu_bodies import (
    BF16_ROWS,
    bf16_choice,
    f32_choice,
    int8_dot_choice,
    int8_tiles_choice,
    moe_split_choice,
    screen_choice,
)
from engine.backends.decoder_layers import decoder_of
from engine.backends.gemm_plan import (
    GemmPlan,
    OneDnnLinear,
    c_panels_plan,
    matmul_peak_gflops,
    measure_plan,
)
from engine.backends.greedy_head import Int8ScreenedHead, ScreenedGreedyHead, pack_head
from engine.backends.packed_linear import PackedLinear, SplitLinear, with_body
from engine.backends.packed_moe import PackedExperts, moe_block_of, token_weight_bytes
from engine.backends.panel_cache import PanelCache
from engine.kernel_plan import KernelChoice, PlanRow
from engine.model_loader import cache_root
from engine.models.linear import Linear, dequantize_weights
from engine.models.llama import MLP, RMSNorm
from engine.models.moe import SparseMoeBlock
from engine.models.quantized import FileBlocks, QuantizedWeight, SplitBlocks
from engine.models.rotary import RotaryEmbedding
from kernels import cdiv
from kernels import cpu as cpu_kernels
from kernels.cpu.decoder import Decoder

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pathlib import Path

    from engine.models.llama import LlamaForCausalLM
    from engine.models.quantized import Blocks

# NOTE: the C decoder attends each prompt token separately, reading its whole prefix (the flash kernel of torch's
# SDPA reuses each K/V row across a tile of queries), so its attention grows with chunk x context. Chunks of up to
# 64 tokens, as decode steps carry them, and chunks of any length within the first 1024 positions are faster in
# the one call (docs/history/benchmarks-2026-11.md); deeper long chunks keep the modules.
DECODER_MAX_QUERY_LEN = 64
DECODER_MAX_PREFILL_CONTEXT = 1024
PACK_CHUNK_PANELS = 512  # panels of a GGUF file's weight packed at a time (_pack_quantized)
# Rows at which an fp32 process times a GGUF file's blocks on AMX (Q4S/Q6S/Q8S panels) against their FMAs: a stream's
# decode, and batches of decodes or a prompt chunk, as BF16_DOT_ROWS.
SPLIT_ROWS = (1, 16, 64)
# Weights (as bytes of bfloat16) over which they are timed: the tiles save FMAs, not bytes, so a working set past L2
# shows it, and more layers only lengthen the start (a 1B model's first 9 layers timed both ways took ~3 s of it).
SPLIT_TIMING_BYTES = 256 << 20


@dataclass(frozen=True)
class PackedEmbedding:
    """Token lookups read from a weight's packed panels (``VocabEmbedding.kernel``)."""

    packed: torch.Tensor
    num_rows: int
    rounded_to: torch.dtype | None = None  # a bfloat16 model's: the rows rounded as its dense table would hold them

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_kernels.embed_rows(self.packed, input_ids, self.num_rows)
        return rows if self.rounded_to is None else rows.to(self.rounded_to).float()


class CpuAttention(TorchAttention):
    """The C kernels store K/V and attend the decodes straight from the pages (no per-layer gather); prefill chunks
    keep torch's flash attention, which is faster for long queries."""

    def store(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        cpu_kernels.store_kv(k, v, k_cache, v_cache, slots)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor
    ) -> None:
        nd = q.shape[0]
        cpu_kernels.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale, out
        )


class CpuBackend(TorchBackend):
    """Owns the packed model's C-side state: the one-call decoder and the screened greedy head."""

    name = "cpu"
    lazy_weights = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.decoder: Decoder | None = None
        self.wide_decoder: Decoder | None = None  # the same layers over their fp32 panels (fp32_panels.py)
        self.wide_rows = 0  # from how many rows on the products read the fp32 panels (timed; 0: none kept)
        self.wide_bytes = 0  # and those panels' bytes (in the ledger's weights)
        self.greedy_head: ScreenedGreedyHead | Int8ScreenedHead | None = None
        self.int8_screen: Int8ScreenedHead | None = None  # a Q8 head's screen, the greedy head where timed faster
        self.argmax_head: PackedLinear | None = None  # the LM head's kernel, where AMX finds its argmax unwritten
        self.plan: GemmPlan | None = None
        self.int8_activations = False
        # the bodies every product runs through: the bfloat16 one chosen while packing (its panels depend on it), the
        # others by the engine's plan (kernel_choices, use_choice)
        self.body = cpu_kernels.DEFAULT_BODY
        self._model: LlamaForCausalLM | None = None  # the packed model, whose products take the plan's bodies
        self._packing_rows: list[PlanRow] = []  # the choices made while packing, with what they measured
        self.widened_panels = 0  # weights whose GGUF blocks AMX widens as it multiplies (timed against BF16A)
        self.split_body: str | None = None  # fp32: a GGUF file's blocks on AMX "tiles" or "FMAs", where timed
        self.panel_cache: PanelCache | None = None  # mapped from, or kept for the next start
        self.moe_split = True  # a mixture of experts' threads take whole experts, not each product (timed: cpu_bodies)

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return "the cpu backend (C kernels) runs float32 or bfloat16 on a CPU only"
        if not cpu_kernels.available():
            return "the cpu backend needs a C compiler (cc/gcc, or $CC) to build kernels/cpu"
        return None

    def make_attention(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> TorchAttention:
        return CpuAttention(num_heads, num_kv_heads, head_dim, scale)

    def prepare(self, model: LlamaForCausalLM, weights_file: Path | None = None) -> None:
        """fp32: every weight in the fewest bytes that hold it exactly. bfloat16: every weight as BF16C panels, computed
        in bfloat16, and the rest (norm weights, biases, rotary tables, activations between the products) in fp32.
        Where oneDNN measured faster (``gemm_plan.py``), every product runs there instead, its weights prepacked."""
        vocab, bf16 = model.config.vocab_size, self.dtype == torch.bfloat16
        pack = cpu_kernels.pack_weight_bf16c if bf16 else cpu_kernels.pack_weight_compact
        first, mlp = model.layers[0], model.first_mlp()
        quantized = mlp.gate_up_proj.quantized is not None
        # a GGUF file's Q4_0/Q4_1/Q4_K, Q6_K and Q8_0/Q5_0 weights, kept as blocks for AMX to widen if that times faster
        blocks = amx_blocks.take(model) if quantized and bf16 and "amx" in cpu_kernels.bf16_dots() else {}
        # an embedding of its own keeps its blocks in bfloat16 too: lookups read its block panels (rounded to
        # bfloat16); a tied one keeps them while the head's may be widened, whose panels the lookups then read
        tied = model.tie_word_embeddings
        lookups = (model.embed_tokens,) if bf16 and (not tied or model.lm_head in blocks) else ()
        if quantized and (bf16 or self.config.gemm_kernels == "onednn"):
            # the fallback: these products take dense weights
            dequantize_weights(model, self.dtype, self.device, keep=lookups)
            quantized = False
        projections = (first.self_attn.qkv_proj, first.self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        dense = {m: blocks[m].dequantize(self.dtype) if m in blocks else m.dense_weight() for m in projections}
        self.int8_activations = quantized and self._int8_activations()
        if bf16 and len(cpu_kernels.bf16_dots()) > 1:  # more than the portable FMAs: time every body
            # NOTE: chosen while packing, not by the engine's plan: AMX takes BF16A panels, the others BF16C ones
            weight = dense[mlp.gate_up_proj]
            row = bf16_choice(PackedLinear(pack(weight), weight.shape[0]), lambda: self.body).decide()
            self._packing_rows.append(row)
            self.body = replace(self.body, bf16=row.chosen)
            if row.chosen == "amx":
                pack = _amx_panels
        if quantized:  # a GGUF file's blocks, packed as they are: only the C panels take them
            self.plan = c_panels_plan(self.dtype)
        else:
            self.plan = measure_plan([dense[m] for m in projections],
                                     lambda w: partial(PackedLinear(pack(w), w.shape[0], body=self.body), bias=None),
                                     self.dtype, self.config.gemm_kernels)
        self._packing_rows.append(self.plan.row())
        del dense
        library = self.plan.uses_library
        if weights_file is not None and self.config.panel_cache and not library:
            self.panel_cache = PanelCache(weights_file, cache_root(), cpu_kernels.panel_layout())
        pack_blocks = partial(_pack_quantized, cache=self.panel_cache)
        kernels = self._widened_kernels(model, blocks) if not library and self.body.bf16 == "amx" else {}
        if quantized and not bf16 and not self.int8_activations and "amx" in cpu_kernels.bf16_dots():
            kernels = self._split_kernels(model)
        for module, source in blocks.items():
            if module not in kernels:  # dense after all, as the other projections
                module.weight = torch.nn.Parameter(source.dequantize(self.dtype), requires_grad=False)
                if module is model.lm_head and tied:  # one table for both, as dequantize_weights keeps it
                    model.embed_tokens.weight, model.embed_tokens.quantized = module.weight, None
                amx_blocks.release(source)
        self.widened_panels = len(kernels) if bf16 else 0
        for name, module in model.named_modules():
            if isinstance(module, Linear) and module in kernels:
                module.kernel = kernels[module]
            elif isinstance(module, Linear) and module.quantized is not None and module is not model.lm_head:
                module.kernel = _quantized_kernel(module.take_quantized(), self.int8_activations, pack_blocks)
            elif isinstance(module, Linear) and module is not model.lm_head:
                module.kernel = OneDnnLinear.pack(module.release_weight()) if library else PackedLinear(
                    self._pack_linear(name, module, pack), module.out_features)
            elif isinstance(module, (RMSNorm, MLP, RotaryEmbedding)):
                module.ops = cpu_kernels
        if bf16:  # the C kernels read these in fp32
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.data = param.data.float()
        if library:  # the one-call decoder and the screened head are C panels' own; the lookups keep their table
            dequantize_weights(model.embed_tokens, self.dtype, self.device)
            model.lm_head.kernel = OneDnnLinear.pack(model.lm_head.release_weight())
            model.embed_tokens.kernel = partial(_fp32_rows, model.embed_tokens.weight.detach())
            return
        if model.lm_head.quantized is not None:
            head = pack_blocks(model.lm_head.take_quantized())
        elif model.lm_head in kernels:  # on the tiles, fp32 or widened: the lookups read these panels too
            head = kernels[model.lm_head].packed
        else:
            head = self._pack_linear("lm_head", model.lm_head, pack if bf16 else pack_head)
        model.lm_head.kernel = PackedLinear(head, model.lm_head.out_features, self.int8_activations)
        # NOTE: the lookups read the LM head's panels where it is tied (the same values), or the embedding's own
        # compact panels where it has such; either way the row-major table is freed (113 MB for SmolLM2-135M in fp32).
        embed, rounded_to = model.embed_tokens, None
        if tied:
            # widened panels give the fp32 values their tiles round: rounded as a bfloat16 table holds them
            lookup, rounded_to = head, self.dtype if bf16 and head.dtype in cpu_kernels.WIDENED_TILE_BYTES else None
        elif embed.quantized is not None:  # a GGUF file's blocks, whose values a bfloat16 table would round
            lookup, rounded_to = pack_blocks(embed.quantized), self.dtype if bf16 else None
        else:
            table = embed.weight.detach()
            lookup = self._pack_dense("embed_tokens", table,
                                      cpu_kernels.pack_weight_bf16c if bf16 else cpu_kernels.pack_weight_blocks)
        if lookup is not None:
            embed.kernel, embed.quantized = PackedEmbedding(lookup, vocab, rounded_to), None
            embed.weight = torch.nn.Parameter(embed.weight.new_empty(0, embed.embedding_dim, device="cpu"),
                                              requires_grad=False)
        if not model.pooling:  # an embedding model's head is a stand-in: no token is ever chosen
            self._attach_greedy_heads(model, head, vocab)
        if not bf16 and self.config.fp32_panels:
            self.wide_rows, row = fp32_panels.attach(model, self._free_memory())
            self.wide_bytes = fp32_panels.held_bytes(model)
            self._packing_rows += [row] if row is not None else []
        self._model = model
        self.use_plan()
        if model.sparse:
            logger.info("a token reads %.0f MiB of the packed weights (its experts' share of the experts: top_k of "
                        "each layer's, at their average size)", token_weight_bytes(model) / 2**20)

    def _attach_greedy_heads(self, model: LlamaForCausalLM, head: torch.Tensor, vocab: int) -> None:
        if head.dtype == torch.float32 and head.shape[1] % 4 == 0 and model.lm_head.bias is None:
            self.greedy_head = ScreenedGreedyHead(head, vocab)
        elif (head.dtype == torch.int8 and model.lm_head.bias is None
              and not self.int8_activations and cpu_kernels.q8x_available()):
            # at every batch size until the engine's plan times it (kernel_choices): its tokens are the exact head's
            self.int8_screen = self.greedy_head = Int8ScreenedHead(head, vocab)
        kernel, probe = model.lm_head.kernel, torch.zeros(1, model.config.hidden_size)
        if (isinstance(kernel, PackedLinear) and model.lm_head.bias is None and not kernel.int8_activations
                and cpu_kernels.argmax_linear(probe, kernel.packed, vocab, body=self.body) is not None):
            self.argmax_head = kernel

    def _widened_kernels(self, model: LlamaForCausalLM,
                         blocks: dict[Linear, Blocks]) -> dict[Linear, PackedLinear | SplitLinear]:
        """The products of ``blocks`` from their Q4A/Q6A/Q8A panels where start-up times those faster than BF16A
        panels (``amx_blocks.py``), packed a weight at a time with its file pages handed back after; else none."""
        bf16a = ("BF16A", lambda b: cpu_kernels.pack_weight_bf16a(b.dequantize(self.dtype)))
        made, seconds = amx_blocks.timed(model, blocks, BF16_ROWS, bf16a)
        self._packing_rows.append(PlanRow("bf16 GGUF blocks", "widened" if amx_blocks.faster(seconds) else "BF16A",
                                          seconds, f"the first layers at {' + '.join(map(str, BF16_ROWS))} rows"))
        if not amx_blocks.faster(seconds):
            return {}
        kernels = {}
        for module, source in blocks.items():
            kernels[module] = _panel_kernel(made.pop(module) if module in made else amx_blocks.panels(source), source)
            amx_blocks.release(source)
        return kernels

    def _split_kernels(self, model: LlamaForCausalLM) -> dict[Linear, PackedLinear | SplitLinear]:
        """The products of a GGUF file's blocks that widened panels hold (Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, Q5_0) in an
        fp32 process from Q4S, Q6S and Q8S panels, computed on AMX tiles to fp32's accuracy (``arch/x86/amx_bf16.c``),
        where start-up times those faster than their block panels' FMAs on the first layers (``amx_blocks.timed``);
        else none, and the blocks stay with their modules. Each weight's format is one body for every batch size,
        so tokens do not depend on the batch."""
        modules = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head
                   and amx_blocks.kind_of(m.quantized)]
        if not modules:
            return {}
        # NOTE: an LM head of Q8 panels (Q8_0) keeps them for its int8 screen (greedy_head.py), which start-up
        # times against the exact head; a Q4 or Q6 head (a Q4_K_M file's Q6_K output) has no screen, and its full
        # product at every step took 28% of a 1B model's 16-client step on the FMAs, so it follows the layers.
        if amx_blocks.kind_of(model.lm_head.quantized) in ("q4", "q6"):
            modules.append(model.lm_head)
        pack = _each_part(partial(_pack_split, cache=self.panel_cache))
        rival = _each_part(partial(_pack_quantized, cache=self.panel_cache))
        made, seconds = amx_blocks.timed(model, {m: m.quantized for m in modules}, SPLIT_ROWS, ("blocks", rival), pack,
                                      SPLIT_TIMING_BYTES)
        self.split_body = "tiles" if amx_blocks.faster(seconds) else "FMAs"
        self._packing_rows.append(PlanRow("fp32 GGUF blocks", self.split_body, seconds,
                                          f"the first layers at {' + '.join(map(str, SPLIT_ROWS))} rows"))
        if self.split_body != "tiles":
            return {}
        kernels = {}
        for module in modules:
            blocks = module.take_quantized()
            kernels[module] = _panel_kernel(made.pop(module) if module in made else pack(blocks), blocks)
            amx_blocks.release(blocks)
        return kernels

    def _int8_activations(self) -> bool:
        """Whether a GGUF file's products take int8 activations: asked for (int8, or auto, the default), and this
        CPU has the integer dot products. Recorded as a row of the kernel plan."""
        mode, available = self.config.quantized_matmul, cpu_kernels.q8x_available()
        if mode == "int8" and not available:
            logger.warning("--quantized-matmul int8 needs integer dot products (VNNI, or AVX2's maddubs), which this "
                           "CPU lacks: the products stay exact")
        chosen = "int8" if mode != "exact" and available else "exact"
        why = {"auto": "auto: int8 where the CPU has integer dot products", "exact": "asked for", "int8": "asked for"}
        self._packing_rows.append(PlanRow("GGUF products", chosen, {}, "", why[mode]))
        return chosen == "int8"

    def forward(self, model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Through the one-call decoder where it is faster, as a query per token: a prompt token at position p
        attends positions 0..p of its request (stored before any attention runs), which is causal attention over
        the chunk and its prefix."""
        if self.decoder is None or (meta.max_query_len > DECODER_MAX_QUERY_LEN
                                    and meta.max_prefill_seq_len > DECODER_MAX_PREFILL_CONTEXT):
            return super().forward(model, input_ids, positions, kv_caches, meta)
        if meta.num_decodes == meta.num_reqs:
            tables, seq_lens = meta.block_tables, meta.seq_lens
        else:
            tables = meta.block_tables[meta.req_of_token]
            seq_lens = (positions + 1).to(torch.int32)
        x = model.embed_tokens(input_ids)
        wide = self.wide_decoder is not None and input_ids.shape[0] >= self.wide_rows
        hidden = (self.wide_decoder if wide else self.decoder)(x, positions, meta.slot_mapping, tables, seq_lens,
                                                               kv_caches)
        if hidden is None:  # a tie at the k-th expert: torch.topk breaks it as transformers does, on the modules
            return super().forward(model, input_ids, positions, kv_caches, meta)
        return hidden

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        tokens = None if self.greedy_head is None else self.greedy_head.argmax(hidden)
        if tokens is None and self.argmax_head is not None:
            head = self.argmax_head
            tokens = cpu_kernels.argmax_linear(hidden, head.packed, head.out_features, body=head.body)
        return tokens

    def packing_choices(self) -> list[PlanRow]:
        return list(self._packing_rows)

    def kernel_choices(self) -> list[KernelChoice]:
        """The bodies left to the engine's plan (``cpu_bodies.py``), each timed on the first layer's gate/up
        projection (the largest): the fp32 body of many rows, or the int8 products' dot product and AMX tiles; and
        the batch sizes at which the LM head's int8 screen is faster than its exact product."""
        model, choices, body = self._model, [], lambda: self.body
        if model is None:  # oneDNN's products: no bodies of ours
            return choices
        gate_up = model.first_mlp().gate_up_proj.kernel
        if self.int8_activations:
            if len(cpu_kernels.q8x_dots()) > 1:
                choices.append(int8_dot_choice(gate_up, body))
            if cpu_kernels.q8x_tiles_available():
                choices.append(int8_tiles_choice(gate_up, body))
        elif (self.dtype == torch.float32 and len(cpu_kernels.f32_bodies()) > 1
              and all(cpu_kernels.format_of(part.packed).products == "exact" for part in gate_up.parts)):
            # NOTE: not where the projections run on the tiles (split panels), which no fp32 body computes: timing
            # them there measured nothing, and took 2 s of each start of an 8B model, twice
            choices.append(f32_choice(gate_up, body))
        if self.int8_screen is not None:
            choices.append(screen_choice(self.int8_screen, body))
        block = next((layer.mlp.kernel for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)), None)
        if block is not None:
            choices.append(moe_split_choice(block.block))
        return choices

    def use_choice(self, row: PlanRow) -> None:
        if row.name == "fp32 body":
            self.body = replace(self.body, f32=row.chosen)
        elif row.name == "int8 dot":
            self.body = replace(self.body, int8_dot=row.chosen)
        elif row.name == "int8 tile rows":
            self.body = replace(self.body, int8_tile_rows=int(row.chosen))
        elif row.name == "moe threads":
            self.moe_split = row.chosen == "experts"
        elif row.name == "int8 screen rows":
            screen = self.int8_screen
            first, _, last = row.chosen.partition("-")
            screen.min_rows, screen.max_rows = (int(first), int(last)) if last else (0, 0)
            self.greedy_head = screen if screen.max_rows else None

    def use_plan(self) -> None:
        """Every product of the packed model through ``self.body``: its modules' kernels, the LM head's, the int8
        screen's, and the one-call decoders, made again over them."""
        model = self._model
        if model is None:
            return
        for module in model.modules():
            if isinstance(module, Linear):
                module.kernel = with_body(module.kernel, self.body)
        if self.argmax_head is not None:
            self.argmax_head = model.lm_head.kernel
        if self.int8_screen is not None:
            self.int8_screen.body = self.body
        for layer in model.layers:  # a mixture of experts' block in one call, over its experts' kernels as set above
            if isinstance(layer.mlp, SparseMoeBlock):
                block = moe_block_of(layer.mlp, self.moe_split)
                layer.mlp.kernel = PackedExperts(block) if block is not None else None
        # NOTE: a tensor-parallel rank's layers must stop twice a layer for the ranks' sums, which the one C call
        # cannot; its steps go through the modules, whose products are the same panels.
        if self.config.tensor_parallel_size == 1:
            self.decoder = decoder_of(model, self.int8_activations, self.body)
            self.wide_decoder = decoder_of(model, self.int8_activations, self.body, wide=True) if self.wide_rows \
                else None

    def _pack_dense(self, name: str, weight: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor | None],
                    read: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """``pack(weight)``, module ``name``'s panels: mapped from the panel cache where it holds them. ``read``: the
        weight's values, where ``weight`` gives only its shape and dtype (on the meta device, not read yet)."""
        if self.panel_cache is None:
            return pack(read() if read is not None else weight)
        return self.panel_cache.pack_dense(name, weight, pack, read)

    def _pack_linear(self, name: str, module: Linear,
                     pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Linear layer ``name``'s panels (``_pack_dense``), its weight let go after: read only where packed here."""
        panels = self._pack_dense(name, module.weight, pack, module.dense_weight)
        module.drop_weight()
        return panels

    def after_start_up(self) -> None:
        if self.plan is not None:  # see gemm_plan.PEAK_BUDGET_S
            self.plan = replace(self.plan, peak_gflops=matmul_peak_gflops(self.dtype))
            logger.info("machine matmul peak (%s, torch's product of large squares): %.0f GFLOP/s", self.plan.dtype,
                        self.plan.peak_gflops)

    def started(self) -> None:
        # NOTE: not at the end of prepare: the write beside the start-up's timings slowed them (an 8B Q4_K_M's 8-token
        # prefill probe read 880-895 ms with the write running, 364-369 without; the matmul peak 206-301 GFLOP/s
        # against 361-366)
        if self.panel_cache is not None:
            self.panel_cache.finish(wait=False)

    def mapped_weight_bytes(self) -> int:
        return self.panel_cache.mapped_bytes if self.panel_cache is not None else 0

    def weight_holders(self) -> list[object]:
        return [self.decoder, self.wide_decoder, self.greedy_head, self.int8_screen]

    def describe(self) -> str:
        """The products in a few words; what was chosen, and why, is the engine's kernel plan (its table)."""
        products = "oneDNN" if self.plan is not None and self.plan.uses_library else "C"
        int8 = ", int8 activations on the GGUF blocks" if self.int8_activations else ""
        return f"cpu backend ({products} products{int8})"


def _amx_panels(weight: torch.Tensor) -> torch.Tensor:
    """BF16A panels, two whole AMX tiles wide, where K allows (a multiple of 32), else BF16C panels, which
    avx512_bf16's dot product then computes (tiles take K 32 at a time): per weight, so still one body whatever
    the batch."""
    if weight.shape[1] % 32 == 0:
        return cpu_kernels.pack_weight_bf16a(weight)
    return cpu_kernels.pack_weight_bf16c(weight)


def _quantized_kernel(weight: Blocks, int8_activations: bool,
                      pack: Callable[[FileBlocks | QuantizedWeight], torch.Tensor] | None = None
                      ) -> PackedLinear | SplitLinear:
    """``weight``'s product, its panels made by ``pack`` (default ``_pack_quantized``)."""
    if isinstance(weight, SplitBlocks):
        return SplitLinear(_quantized_kernel(weight.head, int8_activations, pack),
                           _quantized_kernel(weight.tail, int8_activations, pack))
    return PackedLinear((pack or _pack_quantized)(weight), weight.shape[0], int8_activations)


def _pack_quantized(weight: FileBlocks | QuantizedWeight, cache: PanelCache | None = None) -> torch.Tensor:
    """A GGUF file's blocks as the panels of their kind (``kernels/cpu/blocks.py``), with the same products as
    the fp32 panels of their dequantized values: straight from the file's bytes where they still are (its pages
    handed back after; or ``cache``'s, where an earlier start packed them), else from the decoded blocks,
    PACK_CHUNK_PANELS panels at a time into the result (the copies packing makes stay ~100 MB even for an 8B
    model's LM head)."""
    if isinstance(weight, FileBlocks):
        def pack() -> torch.Tensor:
            return cpu_kernels.pack_gguf_rows(weight.type_id, weight.addresses(), weight.in_features)

        packed = cache.pack(weight, pack) if cache is not None else pack()
        weight.release()
        return packed
    width, rows = cpu_kernels.panel_width(), weight.shape[0]
    out = None
    for start in range(0, rows, PACK_CHUNK_PANELS * width):
        part = weight.rows(slice(start, start + PACK_CHUNK_PANELS * width))
        packed = cpu_kernels.pack_blocks(part.kind, part.values(), part.d, part.m, part.sub)
        if out is None:
            out = packed.new_empty(cdiv(rows, width), *packed.shape[1:])
        out[start // width:start // width + packed.shape[0]] = packed
    return out


def _pack_split(weight: FileBlocks | QuantizedWeight, cache: PanelCache | None = None) -> torch.Tensor:
    """Q4S, Q6S or Q8S panels of blocks (``amx_blocks.split_panels``): ``cache``'s, where an earlier start packed
    them."""
    if isinstance(weight, FileBlocks) and cache is not None:
        return cache.pack(weight, partial(amx_blocks.split_panels, weight), kind="split")
    return amx_blocks.split_panels(weight)


def _each_part(pack: Callable[[FileBlocks | QuantizedWeight], torch.Tensor]) -> Callable[[Blocks], amx_blocks.Panels]:
    """``pack`` over blocks, or over each part of a fused projection of two types (a head's panels and a tail's)."""
    def packed(weight: Blocks) -> amx_blocks.Panels:
        return (pack(weight.head), pack(weight.tail)) if isinstance(weight, SplitBlocks) else pack(weight)
    return packed


def _panel_kernel(packed: amx_blocks.Panels, blocks: Blocks) -> PackedLinear | SplitLinear:
    """The product of a weight's panels, or of a fused projection's head's and tail's (``SplitLinear``)."""
    if isinstance(packed, tuple):
        n = blocks.head.shape[0]
        return SplitLinear(PackedLinear(packed[0], n), PackedLinear(packed[1], blocks.shape[0] - n))
    return PackedLinear(packed, blocks.shape[0])


def _fp32_rows(table: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Lookups as fp32 rows, the activations' type between the products, whatever the table's dtype."""
    return table[input_ids].float()
