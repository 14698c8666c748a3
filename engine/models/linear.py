"""Linear layers: packed C kernels on an fp32 CPU, otherwise the fastest BLAS this process has.

The default on an fp32 CPU is ``kernels/cpu`` (``Linear.pack_for_cpu_kernels``). Without a C compiler, or with
``--attention-backend torch``, products go through ``linear`` below.

NOTE (measured on the 2-core AMD EPYC development machines, fp32): numpy's OpenBLAS (Haswell kernels) beats the
MKL inside torch at every shape the engine produces: ~22 GB/s vs ~12 GB/s streaming weights for one decode row,
~70 vs ~40 GFLOP/s at 64 rows, ~80 vs ~65 GFLOP/s for prefill chunks. Interleaving the two libraries is only fast
with ``OMP_WAIT_POLICY=PASSIVE`` (set by ``engine/__init__.py`` before torch loads); otherwise torch's spinning
OpenMP threads starve OpenBLAS's (5x slower), so without it every product stays on torch. Elsewhere (CUDA,
half precision) this is plain ``F.linear``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels

USE_OPENBLAS = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
_warned = False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M, in], weight [out, in]."""
    cpu_fp32 = x.dtype == torch.float32 and x.device.type == "cpu"
    if USE_OPENBLAS and cpu_fp32 and x.dim() == 2:
        out = torch.from_numpy(np.matmul(x.detach().numpy(), weight.detach().numpy().T))
        return out if bias is None else out + bias
    global _warned
    if cpu_fp32 and not _warned:
        _warned = True
        logging.getLogger(__name__).warning(
            "torch was imported before engine without OMP_WAIT_POLICY=PASSIVE: torch-path matmuls stay on torch's "
            "MKL, which is slower on this kind of CPU; import engine first or export OMP_WAIT_POLICY=PASSIVE"
        )
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be packed once for the C kernels (``kernels/cpu``); packing frees the
    original layout, so the model's weights are held once either way."""

    packed: torch.Tensor | None = None

    def pack_for_cpu_kernels(self, pack: Callable[[torch.Tensor], torch.Tensor] = cpu_kernels.pack_weight_compact
                             ) -> None:
        """Packs the weight with ``pack``; by default in the fewest bytes that hold it exactly (Q4, Q8 or BF16
        panels: the same products from less memory traffic), else as fp32 panels."""
        self.packed = pack(self.weight.detach())
        self.weight = nn.Parameter(torch.empty(0, self.in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.linear(x, self.packed, self.out_features, self.bias)
        return linear(x, self.weight, self.bias)
