"""Engine options, validated once when the engine is built.

The names are the ones the CLI exposes as ``--kebab-case`` flags and that ``LLM(**engine_args)`` takes, so a user
moves between the offline API and the server without a dictionary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields

import torch

from kernels import cpu as cpu_kernels

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # 2 GiB: ~45k tokens of SmolLM2-135M in fp32
DEFAULT_GPU_KV_CACHE_FRACTION = 0.85  # of the memory left free once the weights are loaded
# The CPU's step token budget, sized at start-up (EngineCore._size_token_budget). With 64 streams decoding beside
# prefill chunks, the 99th percentile gap between two tokens ran 1.3-1.4x the step's time; steps of ~0.6 s keep it
# under 1 s while a step stays big enough for throughput (384 tokens at 1.55 ms a token). With the per-decode cap
# below, the whole budget is reached by steps with nothing to decode (a burst) or with ~a quarter of it decoding.
CPU_STEP_TARGET_S = 0.6
MIN_CPU_TOKEN_BUDGET, MAX_CPU_TOKEN_BUDGET = 128, 1024
# Prompt tokens a CPU step may carry per decode in it, a waiting request counting as one (Scheduler.prefill_budget).
# A prompt arriving beside running streams then enters in pieces that lengthen their steps by a bounded fraction,
# instead of one ~0.6 s step that stalls all of them: measured at 16 / 64 clients, the 99th percentile inter-token
# gap fell 4-5x / 1.4x and TTFT p50 halved for everything after the first burst (docs/benchmarks.md). 2 with the
# waiting requests counted (3 without, before): the 16-client gap p99 ~25% lower, the same 64-client TTFT p50, a
# burst's TTFT p99 10-15% lower. GPU steps are launch-bound, so a GPU keeps the whole budget.
DEFAULT_CPU_PREFILL_TOKENS_PER_DECODE = 2.0


def cpu_token_budget(seconds_per_token: float, block_size: int = 16) -> int:
    """The most tokens a step of about CPU_STEP_TARGET_S holds, in whole blocks, within the bounds above."""
    budget = int(CPU_STEP_TARGET_S / seconds_per_token) // block_size * block_size
    return max(MIN_CPU_TOKEN_BUDGET, min(MAX_CPU_TOKEN_BUDGET, budget))


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's JSON keys). ``disable_by_batch_size``: no drafts while more requests than
    this are running, where steps are no longer memory-bound and every rejected draft costs compute."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    # NOTE: 2, not 1: a single repeated token is a poor guess. On chat prompts, one stream, min 1 and 2 sped up alike
    # (1.43x, 1.45x), but with 2 70% of the drafts held against 36% (python -m loadtest.spec_decode), and every
    # rejected draft is a wasted row once a step is compute-bound.
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = 4

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config: method must be 'ngram' (the only one served), got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {limit!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str) -> SpeculativeConfig:
        """From a dict or its JSON text, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine core. ``None`` means "derive it from the model or the device"."""

    model: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # Prompt tokens a step may carry per decode in it or request waiting to start (Scheduler.prefill_budget); None: 2
    # on a CPU, no cap on a GPU; 0: no cap (a step takes the whole token budget).
    prefill_tokens_per_decode: float | None = None
    max_model_len: int | None = None
    block_size: int = 16
    # Bytes (an int > 1) or a fraction of free device memory (a float in (0, 1]).
    kv_cache_memory: int | float | None = None
    dtype: str = "auto"
    # The K/V pool's element type: "auto" (the model's dtype: exact, fp32 on a CPU) or "bfloat16" (half the bytes per
    # cached token, so twice the tokens in the same memory and less to read per decode step; each K/V value rounded
    # to 8 significant bits, so greedy tokens can part from transformers' where two logits nearly tie).
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    # On CUDA, steps of up to engine.cuda_graphs.MAX_NUM_TOKENS tokens replay captured graphs unless this is set.
    enforce_eager: bool = False
    seed: int = 0
    num_threads: int | None = None
    # N-gram speculative decoding (engine/spec_decode.py): a SpeculativeConfig, or its dict or JSON text; off if None.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefill_tokens_per_decode is not None and not self.prefill_tokens_per_decode >= 0:
            raise ValueError(f"prefill_tokens_per_decode must be >= 0, got {self.prefill_tokens_per_decode}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None:
            m = self.kv_cache_memory
            if isinstance(m, float) and not 0.0 < m <= 1.0:
                raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {m}")
            if isinstance(m, int) and m <= 1:
                raise ValueError(f"kv_cache_memory in bytes must be > 1, got {m}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto or bfloat16, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, cpu, torch or triton, got {self.attention_backend!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            # NOTE: fp32 on CPU: these CPUs have no native bf16 and the reference (transformers) runs fp32.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolve_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The pool's dtype for a model running in ``dtype``."""
        if self.kv_cache_dtype == "auto":
            return dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs a float32 or bfloat16 model, got {dtype}")
        return torch.bfloat16

    def resolve_attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        if device.type == "cuda":
            return "triton"
        return "cpu" if dtype == torch.float32 and cpu_kernels.available() else "torch"

    def resolve_prefill_tokens_per_decode(self, device: torch.device) -> float | None:
        if self.prefill_tokens_per_decode is None:
            return DEFAULT_CPU_PREFILL_TOKENS_PER_DECODE if device.type == "cpu" else None
        return self.prefill_tokens_per_decode or None

    def resolve_max_num_batched_tokens(self, device: torch.device, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        # NOTE: on a CPU this is where the engine starts: it then times a few prefill steps and resizes the budget
        # to the machine (EngineCore._size_token_budget). On the 2-core development CPUs a step past ~16 tokens costs
        # 1.5-4 ms per token for the 135M default model (instances measured 70-160 GFLOP/s of matmul), so a fixed
        # 512 let steps reach 2.5 s on the slower instances while 384 paid off on the faster ones. Larger budgets
        # only pay off where steps are cheap (GPUs).
        return 256 if device.type == "cpu" else max(8192, min(max_model_len, 16384))
