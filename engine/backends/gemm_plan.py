"""Which matrix-multiply kernel runs a step's projections at each batch size, decided by timing on this machine.

The CPUs this runs on differ (AVX2 only; AVX-512 with avx512_bf16; AMX), and so does which kernel is fastest at
which number of rows. Nothing is chosen from the CPU's name or a flag: at start-up the backend times, on the
model's own first-layer shapes and at M = 1, 4, 16, 64 and 256 rows,
- Harpoon's C panels (``kernels/cpu``: the model's compact or fp32 panels, or BF16C panels for bfloat16), and
- oneDNN through torch, with the weights prepacked once (``torch.ops.mkldnn._reorder_linear_weight`` and
  ``_linear_pointwise``, as vLLM's CPU backend and torch's inductor use it; AMX tiles where the CPU has them).

NOTE: one family serves every bucket. Two families sum a product in different orders, so mixing them by batch size
would give a request's rows different bits depending on what else is in its step, and the engine's contract is
that greedy tokens do not depend on the batch. The library is taken where it is ``LIBRARY_MARGIN`` faster in the
geometric mean over the buckets (a tie goes to the C panels, which also run inside the one-call decoder). A
server's engine also measures the machine's matmul peak for the dtype (torch's product of large squares) once it
has started; the bench reports the steps' GEMM rate against it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch

from engine.kernel_plan import PlanRow
from engine.timing import seconds_per_call

logger = logging.getLogger(__name__)

M_BUCKETS = (1, 4, 16, 64, 256)
# NOTE: the products timed alone leave out what the C family brings beside them: the one-call decoder and the
# screened greedy head. Forced onto oneDNN, SmolLM2-135M in fp32 ran one stream at 32 tok/s against 190 on the C
# panels on an AVX-512 EPYC (docs/history/benchmarks-2026-12.md), where the products alone were within 10% at 16-256
# rows. So the library must win clearly.
LIBRARY_MARGIN = 1.25
BF16_MARGIN = 1.25  # bfloat16 is picked by --dtype auto only where its products are this much faster
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_isa() -> str:
    """The vector ISA this CPU reports, as the flags that matter for matmuls (e.g. ``avx2 avx512f avx512_bf16``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.backends.cpu.get_cpu_capability()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return " ".join(f for f in _ISA_FLAGS if f in flags) or torch.backends.cpu.get_cpu_capability()


@cache
def library_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN through torch packs weights of ``dtype`` on this CPU, tried on a small one. NOTE: its bf16
    reorder refuses CPUs without AVX-512 (bw/vl/dq) or avx_ne_convert ("bf16 path needs the cpu support ..."): on
    an AVX2-only AMD EPYC every bfloat16 start-up failed in the GEMM plan before this check."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class OneDnnLinear:
    """A linear layer's product through oneDNN, its weight prepacked once for this CPU (``Linear.kernel``); the
    activations go in in the model's dtype and come back as fp32, as the C kernels give them."""

    packed: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def pack(cls, weight: torch.Tensor) -> OneDnnLinear:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight, None), weight.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b = None if bias is None else bias.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, b, "none", [], "").float()


@dataclass(frozen=True)
class GemmPlan:
    """Per bucket of rows (a step of M rows takes the smallest bucket >= M, or the largest), the kernel family it
    runs (``c`` or ``onednn``; one family for all, see the module's note), with the rates measured per bucket."""

    isa: str
    dtype: str
    buckets: tuple[int, ...]
    choice: tuple[str, ...]
    gflops: dict[str, tuple[float, ...]]  # candidate -> GFLOP/s per bucket, over the first layer's projections
    peak_gflops: float | None = None  # torch's product of large squares in this dtype, once start-up is done

    def kernel_for(self, num_rows: int) -> str:
        index = next((i for i, b in enumerate(self.buckets) if num_rows <= b), len(self.buckets) - 1)
        return self.choice[index]

    @property
    def uses_library(self) -> bool:
        return "onednn" in self.choice

    def describe(self) -> str:
        rates = ", ".join(f"M={m}: " + " / ".join(f"{name} {rates[i]:.0f}" for name, rates in self.gflops.items())
                          + f" -> {self.choice[i]}" for i, m in enumerate(self.buckets))
        return f"GEMM plan ({self.dtype}, ISA {self.isa}; GFLOP/s): {rates}"

    def row(self) -> PlanRow:
        """The choice as a row of the engine's kernel plan (GFLOP/s are in ``note``: what the family measured)."""
        if not self.gflops:
            return PlanRow("products", self.choice[0], {}, "", "the only family for these weights, or asked for")
        rates = "; ".join(f"{name} " + "/".join(f"{r:.0f}" for r in rates) for name, rates in self.gflops.items())
        return PlanRow("products", self.choice[0], {}, f"the first layer at M={'/'.join(map(str, self.buckets))}",
                       f"GFLOP/s {rates}")

    def as_dict(self) -> dict:
        return {"isa": self.isa, "dtype": self.dtype, "buckets": list(self.buckets), "choice": list(self.choice),
                "gflops": {k: list(v) for k, v in self.gflops.items()}, "peak_gflops": self.peak_gflops}


# NOTE: measured once the engine has started (``CpuBackend.after_start_up``, in a server's engine process), not with
# the plan: the API process loads its tokenizer and modules while the engine loads, and takes one of the two cores
# from it. And the fastest call, not a median: each call runs 60-100 ms on the 2-core AVX2 machines, and their rate
# swings for about a second at a time (65 / 100 / 88 GFLOP/s in one 60-call loop on an idle AMD EPYC). A median of
# three calls measured with the plan gave 59, 90 and 148 on three starts of one instance, and the bench's "of peak"
# column then read 150%.
# NOTE: the rows shrink where a dtype's products are slow: torch's bfloat16 matmul on an AVX2-only CPU ran 0.28
# GFLOP/s, 30 s a [1024, 2048] call, and the five calls held a bf16 server's start for 150 s.
PEAK_BUDGET_S, PEAK_MIN_CALLS, PEAK_MAX_ROWS, PEAK_MIN_ROWS = 0.8, 4, 1024, 8


def matmul_peak_gflops(dtype: torch.dtype) -> float:
    """The machine's matmul peak for ``dtype``: torch's product of [rows, 2048] by [2048, 2048], the fastest of the
    calls made over ``PEAK_BUDGET_S``; rows 1024, or fewer where a call would take over half the budget."""
    b = torch.randn(2048, 2048).to(dtype)
    probe = torch.randn(PEAK_MIN_ROWS, 2048).to(dtype)
    torch.mm(probe, b)
    start = time.perf_counter()
    torch.mm(probe, b)
    per_row = (time.perf_counter() - start) / PEAK_MIN_ROWS
    rows = PEAK_MIN_ROWS
    while rows < PEAK_MAX_ROWS and 2 * rows * per_row <= PEAK_BUDGET_S / 2:
        rows *= 2
    a = torch.randn(rows, 2048).to(dtype)
    out = torch.mm(a, b)
    fastest, calls, start = float("inf"), 0, time.perf_counter()
    while calls < PEAK_MIN_CALLS or time.perf_counter() - start < PEAK_BUDGET_S:
        begin = time.perf_counter()
        torch.mm(a, b, out=out)
        fastest, calls = min(fastest, time.perf_counter() - begin), calls + 1
    return 2 * rows * 2048 * 2048 / fastest / 1e9


def c_panels_plan(dtype: torch.dtype) -> GemmPlan:
    """The plan of a GGUF file's quantized weights, which only the C panels take: nothing to choose, so nothing is
    timed (timing an 8B model's first layer for the record took ~5 s of its start-up)."""
    return _untimed_plan(dtype, "c")


def _untimed_plan(dtype: torch.dtype, family: str) -> GemmPlan:
    plan = GemmPlan(cpu_isa(), str(dtype).removeprefix("torch."), M_BUCKETS, (family,) * len(M_BUCKETS), {})
    logger.info(plan.describe())
    return plan


def measure_plan(weights: list[torch.Tensor], c_kernel: Callable[[torch.Tensor], Callable],
                 dtype: torch.dtype, family: str = "auto") -> GemmPlan:
    """Time both families on ``weights`` ([N, K] in the model's dtype; the first layer's projections).
    ``c_kernel(weight)`` packs one as the model does and returns its product ``x -> y``. ``family``: "auto" takes
    the library where it wins by ``LIBRARY_MARGIN``; "c" or "onednn" is the user's choice, which is not timed (as
    ``c_panels_plan``: nothing to choose; the timing took ~1 s of every start, even a tiny model's)."""
    if family == "onednn" and not library_available(dtype):
        raise ValueError(f"gemm_kernels=onednn, but this torch has no oneDNN linear (torch.ops.mkldnn) for {dtype} on "
                         "this CPU")
    if family != "auto":
        return _untimed_plan(dtype, family)
    flops = [2 * w.shape[0] * w.shape[1] for w in weights]
    candidates = {"c": [c_kernel(w) for w in weights]}
    if library_available(dtype):
        candidates["onednn"] = [partial(OneDnnLinear.pack(w), bias=None) for w in weights]
    rates: dict[str, list[float]] = {name: [] for name in candidates}
    for m in M_BUCKETS:
        inputs = [torch.randn(m, w.shape[1]) for w in weights]
        for name, kernels in candidates.items():
            seconds = sum(seconds_per_call(lambda k=k, x=x: k(x)) for k, x in zip(kernels, inputs, strict=True))
            rates[name].append(m * sum(flops) / seconds / 1e9)
    library = family == "onednn" or (family == "auto" and "onednn" in rates
                                      and library_speedup(rates) >= LIBRARY_MARGIN)
    choice = ("onednn" if library else "c",) * len(M_BUCKETS)
    plan = GemmPlan(cpu_isa(), str(dtype).removeprefix("torch."), M_BUCKETS, choice,
                    {k: tuple(v) for k, v in rates.items()})
    logger.info(plan.describe())
    return plan


def library_speedup(rates: dict[str, list[float]]) -> float:
    """The geometric mean over the buckets of oneDNN's rate over the C panels': every batch size counts alike, as
    serving runs them all (a sum of times would be decided by the largest bucket alone)."""
    ratios = [d / c for d, c in zip(rates["onednn"], rates["c"], strict=True)]
    return statistics.geometric_mean(ratios)


def bf16_speedup() -> float:
    """How much faster the C kernels compute a product in bfloat16 (BF16C panels, through the fastest body this CPU
    has: AMX tiles, avx512_bf16's dot product or the FMAs) than in fp32 (fp32 panels), at 64 rows of a 2048 x 2048
    weight: > 1 where the CPU has bfloat16 dot products, ~1 or less where they are emulated. The backend then times
    the bodies again on the model's own shapes and keeps one."""
    from kernels import cpu as cpu_kernels

    weight, x = torch.randn(2048, 2048) / 45, torch.randn(64, 2048)
    fp32, bf16 = cpu_kernels.pack_weight(weight), cpu_kernels.pack_weight_bf16c(weight)
    t32 = seconds_per_call(lambda: cpu_kernels.linear(x, fp32, 2048))
    t16 = [seconds_per_call(partial(cpu_kernels.linear, x, bf16, 2048, body=cpu_kernels.Body(bf16=dot)))
           for dot in cpu_kernels.bf16_dots()]
    return t32 / min(t16)
