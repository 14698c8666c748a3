"""Engine options, validated once when the engine is built.

The names are the ones the CLI exposes as ``--kebab-case`` flags and that ``LLM(**engine_args)`` takes, so a user
moves between the offline API and the server without a dictionary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's JSON keys). ``disable_by_batch_size``: no drafts while more requests than
    this are running, where steps are no longer memory-bound and every rejected draft costs compute."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    # NOTE: 2, not 1: a single repeated token is a poor guess. On chat prompts, one stream, min 1 and 2 sped up alike
    # (1.43x, 1.45x), but with 2 70% of the drafts held against 36% (python -m loadtest.lab.spec_decode), and every
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
    # Prompt tokens a step may carry per decode in it or request waiting to start, a CPU step's fixed cost counting
    # as decodes too (Scheduler.prefill_budget); None: 2 on a CPU, no cap on a GPU; 0: no cap (a step takes the
    # whole token budget).
    prefill_tokens_per_decode: float | None = None
    max_model_len: int | None = None
    block_size: int = 16
    # Bytes (an int > 1) or a fraction of free device memory (a float in (0, 1]).
    kv_cache_memory: int | float | None = None
    dtype: str = "auto"
    # The K/V pool's element type: "auto" (the model's dtype: exact, fp32 on a CPU) or "bfloat16" (half the bytes per
    # cached token, so twice the tokens in the same memory and less to read per decode step; each K/V value rounded
    # to 8 significant bits, so greedy tokens can part from transformers' where two logits nearly tie), or "int8"
    # (a CPU's pool only: a quarter of fp32's bytes plus a scale per position and head, kernels/kv_int8.py; each value
    # rounded to 1/254 of its row's largest, so tokens part sooner still).
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    # On CUDA, small steps replay graphs captured at start-up (engine/backends/cuda_graphs.py) unless this is set.
    enforce_eager: bool = False
    seed: int = 0
    num_threads: int | None = None
    # On a CPU, the family that runs the products: "auto" (timed at start-up, engine/backends/gemm_plan.py), "c"
    # (Harpoon's panels and one-call decoder) or "onednn" (prepacked through torch).
    gemm_kernels: str = "auto"
    # N-gram speculative decoding (engine/spec_decode.py): a SpeculativeConfig, or its dict or JSON text; off if None.
    speculative_config: SpeculativeConfig | None = None
    # A GGUF file's products on a CPU: "exact" (fp32 activations times the blocks' values: the bits of the dequantized
    # model's products, so greedy tokens equal transformers'), "int8" (activations rounded to int8 per 32 inputs and
    # integer dot products, as llama.cpp multiplies: faster, not exact), or "auto": int8 where the CPU has the integer
    # dot products (VNNI or AVX2's maddubs), else exact. auto is the default: a GGUF file's users take llama.cpp's
    # arithmetic as given, and exact products served the default model at 0.70/0.63/0.69/0.81x int8's out tok/s at
    # c1/c4/c16/c64 (Ice Lake, VNNI); the agreement is measured in tests/test_smollm2_greedy.py (docs/serving.md).
    quantized_matmul: str = "auto"
    # Ranks the model's layers are split over (engine/tensor_parallel.py): one process each, on the host's cores
    # shared out between them or one GPU each.
    tensor_parallel_size: int = 1
    # Keep the timelines of the last N requests (engine/timeline.py; the server's /debug/requests); 0: off.
    request_timelines: int = 0
    # On a CPU, a GGUF file's packed panels are kept in a cache file ($HARPOON_CACHE/panels) and mapped at the next
    # start instead of packed again (engine/backends/panel_cache.py).
    panel_cache: bool = True
    # On a CPU in fp32, a small model keeps the fp32 panels of its compact ones (at most 1 GiB) for the steps of many
    # rows, where start-up times them faster (engine/backends/fp32_panels.py).
    fp32_panels: bool = True
    # "auto": an embedding checkpoint is served as one (engine/pooling.py), any other generates; "pooling" or
    # "generate" force the choice (vLLM's --runner)
    runner: str = "auto"

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.gemm_kernels not in ("auto", "c", "onednn"):
            raise ValueError(f"gemm_kernels must be auto, c or onednn, got {self.gemm_kernels!r}")
        if self.quantized_matmul not in ("auto", "exact", "int8"):
            raise ValueError(f"quantized_matmul must be auto, exact or int8, got {self.quantized_matmul!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.request_timelines < 0:
            raise ValueError(f"request_timelines must be >= 0, got {self.request_timelines}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
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
        if self.kv_cache_dtype not in ("auto", "bfloat16", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, bfloat16 or int8, got {self.kv_cache_dtype!r}")
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
        import torch  # here, not at the top: the API process imports this module before it starts the engine's

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_kv_cache_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The pool's dtype for a model running in ``dtype`` on ``device``."""
        import torch

        if self.kv_cache_dtype == "auto":
            return dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs a float32 or bfloat16 model, got {dtype}")
        if self.kv_cache_dtype == "int8":
            if device.type != "cpu" or self.attention_backend == "triton":  # the Triton kernels read float pools only
                raise ValueError(f"kv_cache_dtype int8 runs on a CPU's cpu or torch attention only (here: device "
                                 f"{device}, attention backend {self.attention_backend}); use bfloat16 there")
            return torch.int8
        return torch.bfloat16
