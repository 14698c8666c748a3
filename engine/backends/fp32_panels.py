"""fp32 panels kept beside a small model's compact panels, for the steps of many rows.

Why: a product over compact panels (BF16, and the Q4, Q8 and other blocks of ``kernels/cpu/blocks.py``) of more
rows than it computes in registers widens every panel slice into fp32 first, at every step; a step of a few streams
is bound by the bytes it reads, where the compact panels win. On an AMD EPYC (Zen 4) a step's products over the
default model's fp32 panels took 0.82x / 0.88x / 0.92x / 0.94x the time of its Q4 panels at 13 / 26 / 52 / 102 rows
(docs/history/benchmarks-2026-12.md). Where the fp32 copy is small, the process holds both, and a product of at least
the row count from which start-up measured the fp32 panels faster (``from_rows``) reads those. Their values are the ones
the widening gives (``kernels.cpu.widen_panels``), so either gives the same bits and tokens do not depend on which ran.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.backends.packed_linear import PackedLinear, SplitLinear
from engine.kernel_plan import PlanRow
from engine.models.linear import Linear
from engine.timing import best_in_turns
from kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

Kernel = PackedLinear | SplitLinear

# The most fp32 panels a process holds beside its compact ones, and the largest share of the memory free at start
# they may take: SmolLM2-135M's are 0.53 GiB (its Q4 panels 0.14); a 1B model's would be ~4.6 GiB.
MAX_BYTES = 1 << 30
MAX_FREE_SHARE = 0.25
# fp32 panels of the first layers over which start-up times them against the compact ones: past L3, as a step
# streams its weights.
TIMING_BYTES = 256 << 20
CANDIDATE_ROWS = (16, 32, 64)  # and the first row count past the registers (kernels.cpu.register_rows)
TIMING_TURNS = 4


def has_compact_panels(part: PackedLinear) -> bool:
    """Whether ``part`` is a product of exact compact panels, whose fp32 panels ``kernels.cpu.widen_panels`` makes."""
    return not part.int8_activations and part.packed.dtype in cpu_kernels.COMPACT_DTYPES


def fp32_bytes(kernel: Kernel) -> int:
    """The bytes of the fp32 panels of ``kernel``'s compact parts."""
    sizes = (cpu_kernels.packed_geometry(part.packed) for part in kernel.parts if has_compact_panels(part))
    return sum(4 * in_features * columns for in_features, columns in sizes)


def with_fp32_panels(kernel: Kernel, from_rows: int = 0) -> Kernel:
    """``kernel`` with the fp32 panels of its compact parts, read from ``from_rows`` rows on."""
    if isinstance(kernel, SplitLinear):
        return replace(kernel, head=with_fp32_panels(kernel.head, from_rows),
                       tail=with_fp32_panels(kernel.tail, from_rows))
    if not has_compact_panels(kernel):
        return kernel
    wide = kernel.wide if kernel.wide is not None else cpu_kernels.widen_panels(kernel.packed)
    return replace(kernel, wide=wide, wide_rows=from_rows)


def without_fp32_panels(kernel: Kernel) -> Kernel:
    """``kernel`` without fp32 panels."""
    if isinstance(kernel, SplitLinear):
        return replace(kernel, head=without_fp32_panels(kernel.head), tail=without_fp32_panels(kernel.tail))
    return replace(kernel, wide=None, wide_rows=0)


def attach(model: LlamaForCausalLM, free: int) -> tuple[int, PlanRow | None]:
    """Give every compact projection of ``model`` and its LM head their fp32 panels where they fit (at most
    MAX_BYTES and MAX_FREE_SHARE of ``free``) and start-up measures them faster from some row count on: that row
    count, else 0 (none kept), and the choice as a row of the kernel plan (None where there was none to make)."""
    modules = [m for m in _products(model) if fp32_bytes(m.kernel)]
    total, cap = sum(fp32_bytes(m.kernel) for m in modules), min(MAX_BYTES, int(free * MAX_FREE_SHARE))
    if not modules or total > cap:
        if not modules:
            return 0, None
        note = f"they would take {total / 2**20:.0f} MiB, over {cap / 2**20:.0f}"
        return 0, PlanRow("fp32 panels beside", "none", {}, "", note)
    timed, size = [], 0
    for module in modules:  # the first layers' (the LM head is last)
        if size >= TIMING_BYTES:
            break
        module.kernel = with_fp32_panels(module.kernel)
        timed.append(module.kernel)
        size += fp32_bytes(module.kernel)
    rows, seconds = from_rows(timed)
    for module in modules:
        module.kernel = with_fp32_panels(module.kernel, rows) if rows else without_fp32_panels(module.kernel)
    where = f"{len(timed)} weights, {total / 2**20:.0f} MiB of fp32 panels"
    return rows, PlanRow("fp32 panels beside", f"from {rows} rows" if rows else "none", seconds, where)


def held_bytes(model: LlamaForCausalLM) -> int:
    """The bytes of the fp32 panels ``model``'s products hold beside their compact ones."""
    return sum(part.wide.nbytes for m in _products(model) for part in m.kernel.parts if part.wide is not None)


def from_rows(kernels: list[Kernel]) -> tuple[int, dict[str, float]]:
    """The fewest of the candidate row counts from which, at that count and every larger one, ``kernels``' products
    (their fp32 panels attached) took less time over the fp32 panels than over the compact ones, 0 where none did;
    and the seconds each took at each count timed.
    Measured, not assumed: where widening a slice costs little beside its FMAs, or the fp32 panels' four times the
    bytes cost more than it saves, the compact panels win at every count."""
    candidates = sorted({cpu_kernels.register_rows() + 1, *CANDIDATE_ROWS})
    in_features = {cpu_kernels.packed_geometry(part.packed)[0] for kernel in kernels for part in kernel.parts}
    chosen, timings = 0, {}
    for rows in reversed(candidates):  # the most rows first: below the first loss nothing more is timed
        x = {k: torch.randn(rows, k) for k in in_features}
        seconds = best_in_turns({name: partial(_each, kernels, x, name == "fp32") for name in ("compact", "fp32")},
                                turns=TIMING_TURNS)
        timings |= {f"{name}@{rows}": value for name, value in seconds.items()}
        if seconds["fp32"] >= seconds["compact"]:
            break
        chosen = rows
    return chosen, timings


def _each(kernels: list[Kernel], x: dict[int, torch.Tensor], wide: bool) -> None:
    """Every kernel's product of its rows of ``x``, over its fp32 panels where ``wide`` and it has them."""
    for kernel in kernels:
        for part in kernel.parts:
            rows = x[cpu_kernels.packed_geometry(part.packed)[0]]
            cpu_kernels.linear(rows, part.read(wide), part.out_features)


def _products(model: LlamaForCausalLM) -> list[Linear]:
    """``model``'s linear layers whose products are packed panels."""
    return [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.kernel, (PackedLinear, SplitLinear))]
