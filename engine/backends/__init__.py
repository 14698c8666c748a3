"""The backend registry: one backend object per engine, chosen once at start-up, and the dtype it runs.

``--attention-backend`` names one (``torch``, ``cpu``, ``triton``), or ``auto`` picks: ``triton`` on CUDA, ``cpu``
where its C kernels can run the dtype, else ``torch``. ``--dtype auto`` is bfloat16 on CUDA; on a CPU it is
bfloat16 where the checkpoint is bfloat16 and the C kernels measured its products at least ``BF16_MARGIN`` faster
than fp32 ones on this machine (a CPU with bfloat16 dot products), else fp32, exact against transformers. Nothing is
decided at import time.
"""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

from engine.backends.base import TorchBackend
from engine.backends.cpu import CpuBackend
from engine.backends.cuda import TritonBackend
from engine.backends.gemm_plan import BF16_MARGIN, bf16_speedup, cpu_isa
from engine.config import EngineConfig

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[TorchBackend]] = {"torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend}


def backend_name(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The backend ``config`` asks for, ``auto`` resolved for this device and dtype."""
    if config.attention_backend != "auto":
        return config.attention_backend
    if device.type == "cuda":
        return "triton"
    return "cpu" if CpuBackend.unsupported(device, dtype) is None else "torch"


def select_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> TorchBackend:
    """The backend object for this engine; ValueError if the one asked for cannot run here."""
    cls = BACKENDS[backend_name(config, device, dtype)]
    problem = cls.unsupported(device, dtype)
    if problem is not None:
        raise ValueError(problem)
    return cls(config, device, dtype)


def checkpoint_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    """The dtype the checkpoint's weights were saved in, where its config says."""
    name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name).removeprefix("torch."), None) if name else None


def resolve_dtype(config: EngineConfig, device: torch.device, hf_config: PretrainedConfig) -> torch.dtype:
    """The dtype the engine runs: ``--dtype`` as given, or for ``auto`` the choice the module docstring describes."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cuda":
        return torch.bfloat16
    if checkpoint_dtype(hf_config) != torch.bfloat16 or CpuBackend.unsupported(device, torch.bfloat16) is not None:
        return torch.float32
    speedup = bf16_speedup()
    dtype = torch.bfloat16 if speedup >= BF16_MARGIN else torch.float32
    logger.info("dtype auto: bfloat16 products ran %.2fx as fast as fp32 (ISA %s): %s", speedup, cpu_isa(), dtype)
    return dtype
