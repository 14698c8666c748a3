"""Greedy tokens from the fp32 LM head while reading a quarter of its bytes, with the same result as the full head.

At batch 1 a CPU decode step is bound by streaming every weight once, and a small model's LM head is a large part
of them (SmolLM2-135M in fp32: 113 of 540 MB). A greedy row needs only the argmax of its logits. An int8 copy of the
head gives approximate logits ``a``, and for every vocabulary row j a bound ``|a_j - l_j| <= ||h|| e_j`` holds, where
``l`` are the logits the fp32 head computes for the hidden state ``h`` (``e`` from ``row_error_bounds``). The
argmax of ``l`` is at least the largest lower bound ``max_j (a_j - ||h|| e_j)``, so only the j whose upper bound
reaches it can be the argmax. Those candidates (a median of 3 per token on SmolLM2, at most 37) are computed
again by the fp32 kernel, which gives each the very bits of the full product (``hp_linear`` runs one FMA sequence
per output, whichever columns are packed with it). Their argmax, the lowest index on a tie as ``torch.argmax``
picks, is the argmax of the full logits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.sampler import argmax_rows
from kernels import cpu as cpu_kernels

# NOTE: the int8 product streams a quarter of the bytes but widens every weight, so it is compute-bound sooner:
# on the 2-core AMD EPYC development machines it took 1.4 / 1.5 / 2.4 / 4.7 ms at 1 / 2 / 4 / 8 rows against
# the fp32 head's 3.5 / 4.0 / 4.6 / 5.8 ms, and was slower from 16 rows on.
MAX_ROWS = 8
MAX_CANDIDATES = 256  # per row; more (a flat distribution, a huge ||h||) and the full head is cheaper
BUILD_CHUNK = 2**22  # weights per chunk while building: the float64 temporaries of the bound stay ~32 MB


def row_error_bounds(weight: torch.Tensor, quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e [N] float64 with ``|a_j - l_j| <= ||h||_2 e_j`` for any finite h, where ``a_j`` is ``hp_linear_i8``'s
    output and ``l_j`` ``hp_linear``'s, both over K = in_features terms. With ``w^_j = scale_j q_j`` and
    ``g(n) = n u / (1 - n u)`` (u = 2^-24, the fp32 unit roundoff; a dot product of n terms, summed in any order,
    errs by at most g(n) sum |h_k w_jk| <= g(n) ||h|| ||w_j||):
        |a_j - h.w^_j| <= g(K + 1) ||h|| ||w^_j||   (the sum, then the product with the scale)
        |h.w^_j - h.w_j| <= ||h|| ||w^_j - w_j||     (Cauchy-Schwarz)
        |h.w_j - l_j| <= g(K) ||h|| ||w_j||
    Computed in float64 and rounded up by a relative 2^-20, far above float64's own rounding here."""
    w = weight.double()
    w_hat = quantized.double() * scales.double().unsqueeze(1)
    k = w.shape[1]
    u = 2.0**-24
    g = (k + 1) * u / (1 - (k + 1) * u)
    e = (w_hat - w).norm(dim=1) + g * (w_hat.norm(dim=1) + w.norm(dim=1))
    return e * (1 + 2.0**-20)


def pack_head(weight: torch.Tensor) -> torch.Tensor:
    """An LM head's panels: Q4 or Q8 where they hold it exactly (``pack_weight_blocks``), else fp32 panels, which a
    ``ScreenedGreedyHead`` screens. NOTE: the full product from Q8 panels (1.125 bytes a weight) took as long as
    the screen at 1-2 rows and less from 4 (SmolLM2's Q8_0 embedding: 3.2 / 2.6 / 3.2 / 5.4 ms at 1 / 2 / 4 / 8 rows
    against 3.0 / 2.6 / 3.8 / 6.3, fp32 panels 6.5 / 5.7 / 5.5 / 7.3), so such a head is not screened; bf16 values
    keep fp32 panels here, as BF16 panels (2 bytes) would read more than the screen's int8 copy."""
    packed = cpu_kernels.pack_weight_blocks(weight)
    return cpu_kernels.pack_weight(weight) if packed is None else packed


class ScreenedGreedyHead:
    """The argmax of ``hp_linear(h, packed_head)`` over the first ``vocab_size`` columns, for up to ``MAX_ROWS``
    rows of h, computed as the module docstring says."""

    def __init__(self, packed_head: torch.Tensor, vocab_size: int) -> None:
        self.packed_head = packed_head  # [panels, K, P]: the fp32 head, shared with the model
        self.vocab_size = vocab_size
        panels, k, width = packed_head.shape
        step = max(1, BUILD_CHUNK // (k * width))  # panels at a time, whatever the head's size
        quantized, scales, errors = [], [], []
        for p0 in range(0, panels, step):
            chunk = packed_head[p0 : p0 + step]
            n = min(vocab_size - p0 * width, chunk.shape[0] * width)
            weight = chunk.permute(0, 2, 1).reshape(-1, k)[:n]
            q, scale = cpu_kernels.pack_weight_int8(weight)
            quantized.append(q)
            scales.append(scale)
            errors.append(row_error_bounds(weight, cpu_kernels.int8_rows(q, n), scale[:n]))
        self.quantized, self.scales, self.error = torch.cat(quantized), torch.cat(scales), torch.cat(errors)
        if not torch.isfinite(self.error).all():
            raise ValueError("the LM head has non-finite weights")

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Token ids [M] int64 for hidden [M, K] fp32, or None where screening does not pay (too many rows or
        candidates) or cannot decide (a non-finite value): the caller then computes the full logits."""
        m = hidden.shape[0]
        if m == 0 or m > MAX_ROWS:
            return None
        approx = cpu_kernels.linear_int8(hidden, self.quantized, self.scales, self.vocab_size)
        tokens = cpu_kernels.screened_argmax(hidden, approx, self.error, self.packed_head, MAX_CANDIDATES)
        return None if bool((tokens < 0).any()) else tokens


# Row counts at which start-up times a block head's int8 screen against its exact product (``screen_row_range``), up
# to the first whose exact call takes longer than SCREEN_TIMING_CALL_S: a real-size model's head (128k x 4096 as
# Q8_0) would spend seconds of every start on its larger counts, which then keep the exact head.
SCREEN_TIMING_ROWS = (1, 4, 16, 64, 256)
SCREEN_TIMING_CALL_S = 0.05


class Int8ScreenedHead:
    """The argmax of the exact product of an LM head held as Q8 panels (a GGUF file's Q8_0 output, or the Q8_0 token
    table tied to it, as SmolLM2's), from the int8-activation product of the same panels, for batches of
    ``min_rows`` .. ``max_rows`` rows. That product (``linear(..., int8_activations=True)``: integer dot products,
    VNNI's or maddubs) ran ~2x faster than the exact one from 16 rows on (AVX-512 VNNI, the head out of the caches,
    docs/history/benchmarks-2026-12.md), and it is within ``||w'_j|| s`` of the exact logit l_j, where w'_j
    is column j's weights (the fp32 values the exact product uses, d q with no rounding) and for the row h:
        |a_j - h^.w'_j| <= g(B + 4) ||h^|| ||w'_j||   (the integer sums exact; per 32 k two roundings, then the sum)
        |h^.w'_j - h.w'_j| <= E ||w'_j||               (Cauchy-Schwarz, E = ||h - h^||, the int8 rounding of h)
        |h.w'_j - l_j| <= g(K + 1) ||h|| ||w'_j||      (the exact product's FMAs, in any order)
    with h^ the rounded row (||h^|| <= ||h|| + E), B = K / 32 and g(n) = n u / (1 - n u), u = 2^-24. So
        s = E (1 + 2 g) + 3 g ||h||,   g = g(K + 8),
    one g more than the sum needs, rounded up by a relative 2^-20. E is measured per row from the very rounding the
    product applies (``q8x_rounding_error``). The columns whose bound reaches the best lower bound are recomputed
    exactly (``screened_argmax``: a median of 1 a row, p90 23, on SmolLM2's hidden states), so the token is the
    exact head's. Building it (the columns' norms, ``row_norms``) and timing it (``screen_row_range``) took 1.4 s of the
    start of an 8B model, whose head is 128k x 4096 Q8_0 (docs/history/benchmarks-2026-12.md)."""

    def __init__(self, packed: torch.Tensor, vocab_size: int) -> None:
        if packed.dtype != torch.int8:
            raise ValueError(f"an int8 screen takes Q8 panels, got {packed.dtype}")
        self.packed, self.vocab_size = packed, vocab_size
        self.body = cpu_kernels.DEFAULT_BODY  # the int8 and exact products' bodies (start-up's plan)
        # every batch size, until start-up's timing narrows it (screen_row_range)
        self.min_rows, self.max_rows = 1, 1 << 30
        self.error = cpu_kernels.row_norms(packed, vocab_size) * (1 + 2.0**-20)
        if not torch.isfinite(self.error).all():
            raise ValueError("the LM head has non-finite weights")
        k = packed.shape[1] * 32
        u = 2.0**-24
        self.gamma = (k + 8) * u / (1 - (k + 8) * u)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Token ids [M] int64 for hidden [M, K] fp32, or None where the screen is not used (M outside ``min_rows``
        .. ``max_rows``) or a value is not finite. A row with more than ``MAX_CANDIDATES`` candidates (a flat
        distribution, or a row whose int8 rounding errs much: an outlier sharing its 32 inputs with small values)
        takes its token from its exact logits, as the full head would give it."""
        m = hidden.shape[0]
        if m == 0 or not self.min_rows <= m <= self.max_rows:
            return None
        approx = cpu_kernels.linear(hidden, self.packed, self.vocab_size, int8_activations=True, body=self.body)
        scale = self.row_scale(hidden)
        if not bool(torch.isfinite(scale).all()):
            return None
        tokens = cpu_kernels.screened_argmax(hidden, approx, self.error, self.packed, MAX_CANDIDATES, scale)
        undecided = (tokens < 0).nonzero().flatten()
        if len(undecided):  # NOTE: 3 of ~60 steps of the 8 test prompts on SmolLM2 have such a row
            tokens[undecided] = self.exact_argmax(hidden[undecided])
        return tokens

    def exact_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids [M] from the exact head's full logits: what the screen must equal."""
        return argmax_rows(cpu_kernels.linear(hidden, self.packed, self.vocab_size, body=self.body))

    def row_scale(self, hidden: torch.Tensor) -> torch.Tensor:
        """s [M] float64: |int8-activation logit j - exact logit j| <= s_m error_j for row m of ``hidden``."""
        rounding, g = cpu_kernels.q8x_rounding_error(hidden), self.gamma
        return (rounding * (1 + 2 * g) + 3 * g * hidden.double().norm(dim=1)) * (1 + 2.0**-20)


def screen_row_range(screen: Int8ScreenedHead) -> tuple[tuple[int, int], dict[str, float]]:
    """The batch sizes for which ``screen`` measured faster than the exact head and its argmax: the first run of
    ``SCREEN_TIMING_ROWS`` at each of which it won, as (fewest, most) rows, or (0, 0), and the seconds each took at each
    count. Each call finds the head out
    of the caches, as a step does after streaming the layers' weights: one row is bound by reading the head either
    way, and the screen only adds to it; from a few rows on the exact product's FMAs bound it and the integer dot
    products win. The rows are the head's own columns, scaled: each has a clear argmax and few candidates, as a
    confident token has. Measured here, as the int8 dot product's speed against the FMAs' differs from one CPU to
    the next (AVX2's maddubs is no faster than the exact product at 64 rows)."""
    packed, vocab = screen.packed, screen.vocab_size
    flush = torch.zeros(_flush_bytes() // 4)
    wins, seconds = [], {}
    for rows in SCREEN_TIMING_ROWS:
        hidden = cpu_kernels.embed_rows(packed, torch.linspace(0, vocab - 1, rows).long(), vocab) * 4.0
        screened = _cold_seconds(partial(screen.argmax, hidden), flush)
        exact = _cold_seconds(partial(screen.exact_argmax, hidden), flush)
        seconds |= {f"screen@{rows}": screened, f"exact@{rows}": exact}
        if screened < exact:
            wins.append(rows)
        elif wins:
            break  # the run has ended: larger batches are not timed
        if exact > SCREEN_TIMING_CALL_S:
            break
    return ((wins[0], wins[-1]) if wins else (0, 0)), seconds


def _flush_bytes() -> int:
    """Four times the last-level cache, at least 128 MiB: a pass over that many bytes evicts what was cached before.
    NOTE: after a pass over 64 MiB (twice the L3 an AMD EPYC guest reports), a 1-row int8 product over SmolLM2's
    32 MB head still took 0.73-0.81 ms against 1.12 after 256 MiB: a part of the head had stayed cached."""
    try:
        l3 = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        l3 = 0
    return max(4 * l3, 128 << 20)


def _cold_seconds(fn: Callable[[], object], flush: torch.Tensor, rounds: int = 3) -> float:
    """The fastest of ``rounds`` calls of ``fn``, each after ``flush`` has been written over."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        flush.add_(1.0)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
