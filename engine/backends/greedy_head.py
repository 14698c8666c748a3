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

import torch

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
