"""The backend interface, and the plain-torch backend that implements it on any device.

A backend is everything that differs between devices and kernel sets, decided once when the engine starts:
- the attention over the paged pool;
- how weights are packed and which kernels run the layers;
- fused ops and thread settings;
- how a step is run (eagerly, from a captured graph, in one C call);
- what the engine is sized with (step token budget, KV pool bytes);
- what is tuned or warmed up before the first request.

The engine core, the runner and the model never ask which device or kernel set they are on; they ask the backend.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata, TorchAttention
from engine.config import EngineConfig
from engine.kernel_plan import KernelChoice, PlanRow
from engine.kv_cache import available_memory
from engine.models.linear import dequantize_weights
from engine.start_up import WARM_UP_PROMPT_LEN

if TYPE_CHECKING:
    from pathlib import Path

    from engine.kv_cache import KVCache
    from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # 2 GiB: ~45k tokens of SmolLM2-135M in fp32
# Memory a CPU server leaves to the rest of the machine (its API process, the OS, the page cache) before its default
# KV pool takes half of what is free. Why: a Qwen3-30B-A3B Q4_K_M's 17.8 GB of panels on a 24 GiB machine left 4.4 GB
# free, and half of it as the pool put the server at 20.45 GiB, the file's 17.3 plus 3.2.
CPU_HEADROOM_BYTES = 2 << 30
DEFAULT_GPU_KV_CACHE_FRACTION = 0.85  # of the memory left free once the weights are loaded
# Prompt tokens a CPU step may carry per decode in it, a waiting request counting as one. A prompt arriving beside
# running streams then enters in pieces that lengthen their steps by a bounded fraction, instead of one ~0.6 s step
# that stalls all of them (docs/history/benchmarks-2026-11.md).
DEFAULT_CPU_PREFILL_TOKENS_PER_DECODE = 2.0


class TorchBackend:
    """Plain torch on any device: the reference the other backends are checked against, and the fallback where
    their kernels cannot run (no C compiler, an unsupported dtype). Subclasses override what they do their own way.
    """

    name = "torch"
    # Whether ``prepare`` packs every linear layer's weight: then the checkpoint's dense weights reach it unread, as
    # views of its files' mappings (``Linear.parts``), and those whose panels a cache holds are never read.
    lazy_weights = False

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run ``dtype`` on ``device``, or None if it can."""
        return None

    # ---- what the engine is sized with --------------------------------------------------------------------------
    def max_num_batched_tokens(self, max_model_len: int) -> int:
        """The step's token budget unless the user set one. NOTE: on a CPU a step past ~16 tokens costs 1.5-4 ms per
        token of a 135M model on the 2-core development machines, so 256 to start with (the engine resizes it once
        it has timed the machine, ``sizes_token_budget``); GPU steps are cheap and launch-bound."""
        return 256 if self.device.type == "cpu" else max(8192, min(max_model_len, 16384))

    def prefill_tokens_per_decode(self) -> float | None:
        """The scheduler's cap on prompt tokens per decode in a step (``Scheduler.prefill_budget``); None: no cap.
        A CPU step is compute-bound, so a prompt entering beside running streams is taken in small pieces; GPU steps
        are launch-bound and keep the whole budget."""
        if self.config.prefill_tokens_per_decode is not None:
            return self.config.prefill_tokens_per_decode or None
        return DEFAULT_CPU_PREFILL_TOKENS_PER_DECODE if self.device.type == "cpu" else None

    def kv_cache_bytes(self) -> int:
        """The KV pool's budget: ``kv_cache_memory`` as bytes or a fraction of what is free now, else a default."""
        memory = self.config.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                return int(available_memory(self.device) * DEFAULT_GPU_KV_CACHE_FRACTION)
            free = self._free_memory()
            return min(DEFAULT_CPU_KV_CACHE_BYTES, max(free - CPU_HEADROOM_BYTES, free // 2) // 2)
        if isinstance(memory, float):
            return int(self._free_memory() * memory)
        return int(memory)

    def _free_memory(self) -> int:
        """What the device has free, less the weights held as a file's pages, which the host counts as free."""
        return available_memory(self.device) - self.mapped_weight_bytes()

    def mapped_weight_bytes(self) -> int:
        """Bytes of weights held as pages of a file mapping rather than memory of their own."""
        return 0

    # ---- the model ----------------------------------------------------------------------------------------------
    def check_shapes(self, block_size: int, head_dim: int) -> None:
        """Raise ValueError if this backend's kernels cannot run these shapes."""

    def make_attention(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> TorchAttention:
        return TorchAttention(num_heads, num_kv_heads, head_dim, scale)

    def prepare(self, model: LlamaForCausalLM, weights_file: Path | None = None) -> None:
        """Once the weights are loaded (in the engine's dtype): pack them for this backend's kernels. Plain torch
        takes quantized weights (a GGUF file's) dense. ``weights_file``: what the weights were read from, the GGUF file
        or the checkpoint folder, whole (not a tensor-parallel rank's part), where a backend may keep what it makes
        of them."""
        dequantize_weights(model, self.dtype, self.device)

    def bind(self, model: LlamaForCausalLM, kv_cache: KVCache, max_num_batched_tokens: int,
             max_model_len: int) -> None:
        """Once the KV pool and the step budget exist: anything built over them (captured graphs)."""

    def forward(self, model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of one step; host tensors in."""
        dev = self.device
        return model(input_ids.to(dev), positions.to(dev), kv_caches, meta.to(dev))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).argmax(-1)`` without the full logits where this backend can; None where the
        caller must compute the logits."""
        return None

    def sizes_token_budget(self) -> bool:
        """Whether the engine times its step token budget at start-up, unless the user set one
        (``engine/start_up.py``): on a CPU, where a step's time grows with its tokens."""
        return self.device.type == "cpu"

    def warm_up_down_to(self, max_model_len: int) -> int | None:
        """The smallest step the engine's start-up bursts of made-up prompts go down to (``warm_up_bursts``): on a
        GPU, every eager step size from the budget down to one prompt, whose first run compiles and loads its
        kernels; None (no bursts) on a CPU, which has none to compile."""
        return min(WARM_UP_PROMPT_LEN, max_model_len - 2) if self.device.type == "cuda" else None

    # ---- the kernel plan (engine/kernel_plan.py) ----------------------------------------------------------------
    def packing_choices(self) -> list[PlanRow]:
        """The choices made while packing the weights (``prepare``), which the packing depended on, with what their
        candidates measured: rows of the engine's kernel plan."""
        return []

    def kernel_choices(self) -> list[KernelChoice]:
        """The choices this backend's kernels leave open once packed: the engine times them, in order, and gives
        each one's result back (``use_choice``) before it times the next."""
        return []

    def use_choice(self, row: PlanRow) -> None:
        """Take ``row``'s chosen candidate for the products from now on (one of ``kernel_choices``)."""

    def use_plan(self) -> None:
        """Once every choice is made: put them into whatever was built over the products (a one-call decoder)."""

    def after_start_up(self) -> None:
        """In a server's engine process, once warmed up: measure what only an otherwise idle machine shows (the API
        process loads its tokenizer and modules while the engine starts)."""

    def started(self) -> None:
        """Once the engine has started, its start-up timings all taken (``EngineCore._warm_up``,
        ``after_start_up``): start what runs beside serving, which would have slowed those timings."""

    def weight_holders(self) -> list[object]:
        """What this backend keeps of the weights beside the model's modules (packed copies, C-side tables), for
        the memory ledger."""
        return []

    def cuda_graph_bytes(self) -> int:
        """Device memory reserved by captured graphs, for the memory ledger."""
        return 0

    def describe(self) -> str:
        return f"{self.name} backend"

