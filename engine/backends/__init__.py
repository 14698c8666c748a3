"""The backend registry: one backend object per engine, chosen once at start-up.

``--attention-backend`` names one (``torch``, ``cpu``, ``triton``), or ``auto`` picks: ``triton`` on CUDA, ``cpu``
where its C kernels can run the dtype, else ``torch``. Nothing is decided at import time.
"""

from __future__ import annotations

import torch

from engine.backends.base import TorchBackend
from engine.backends.cpu import CpuBackend
from engine.backends.cuda import TritonBackend
from engine.config import EngineConfig

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
