"""A linear weight held as the integer blocks of a GGUF file, between the file and a backend's packed panels.

Why: an 8B model's weights in fp32 are 32 GB, more than the machines it must run on. Decoded from GGUF's bytes
into one of four row forms below, a weight keeps about the bytes its panels will take (0.75 to 1.25 a weight), and a
backend packs it layer by layer (``engine/backends/cpu.py``) or dequantizes it where its kernels need dense weights.

Every form reproduces gguf-py's dequantization bit for bit: the scales are the products gguf-py forms (an fp16 d
times a 6- or 8-bit sub-scale: at most 18 significant bits, exact in fp32), d q is then exact, and the one rounding
is the add of m, as gguf-py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # inputs per block of every form

# kind -> what it holds and which GGUF types decode to it, narrowest first
KINDS = {
    "q4": "d q + m, q in 0..15 (nibbles), d and m per 32 inputs: Q4_0, Q4_1, Q4_K",
    "q8": "d q, q in -128..127, d per 32 inputs: Q8_0, Q5_0",
    "q5": "d q + m, q in 0..31, d and m per 32 inputs: Q5_1, Q5_K",
    "q6": "d q, q in -32..31, d per 16 inputs: Q6_K",
    "q6m": "d q + m, q a byte, d and m per 16 inputs: any of the above, for a fused projection that mixes them",
}
_PER_16 = ("q6", "q6m")  # kinds with a d per 16 inputs
_WITH_M = ("q4", "q5", "q6m")


@dataclass
class QuantizedWeight:
    """A weight [N, K] (K % 32 == 0) in one of ``KINDS``.

    q: q4: uint8 [N, K/32, 16], byte j of a block holding input j (low nibble) and j + 16 (high nibble);
       q5: uint8 [N, K/32, 32]; q6, q6m and q8: int8 [N, K/32, 32].
    d: fp32 [N, K/32] (q6, q6m: [N, K/16]); m: like d for q4, q5 and q6m, else None.
    ggml_type: the file's type name, for messages and the memory ledger."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    ggml_type: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantized kind {self.kind!r}")
        n, groups = self.q.shape[:2]
        scales = (n, groups * (2 if self.kind in _PER_16 else 1))
        if self.d.shape != scales or (self.m is None if self.kind in _WITH_M else self.m is not None) or (
                self.m is not None and self.m.shape != scales):
            raise ValueError(f"{self.kind}: q {tuple(self.q.shape)}, d {tuple(self.d.shape)} and m do not match")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def values(self) -> torch.Tensor:
        """q as one integer per input: [N, K/32, 32], uint8 (q4, q5) or int8 (q6, q8)."""
        if self.kind != "q4":
            return self.q
        return torch.cat([self.q & 15, self.q >> 4], dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K]: gguf-py's values in fp32, then cast to ``dtype``."""
        n, k = self.shape
        q = self.values().float()
        if self.kind in _PER_16:
            q = q.view(n, -1, 2, 16)
        w = self.d.view(*q.shape[:-1], 1) * q
        if self.m is not None:
            w = w + self.m.view(*q.shape[:-1], 1)
        return w.reshape(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows ``index`` (a reordering or a slice of the outputs)."""
        return QuantizedWeight(self.kind, self.q[index], self.d[index], None if self.m is None else self.m[index],
                               self.ggml_type)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights stacked along the outputs (a fused q/k/v or gate/up); they must share a kind."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            # NOTE: Q4_K_M files give attn_v more bits than attn_q and attn_k in some layers; the fused projection
            # then holds all of its rows in a kind wide enough for each.
            kind = "q5" if kinds <= {"q4", "q5"} else "q6m"
            parts = [p.widen(kind) for p in parts]
        first = parts[0]
        return QuantizedWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                               None if first.m is None else torch.cat([p.m for p in parts]),
                               "+".join(dict.fromkeys(p.ggml_type for p in parts)))

    def widen(self, kind: str) -> QuantizedWeight:
        """The same values in a wider kind: q4 -> q5, or any -> q6m."""
        if kind == self.kind:
            return self
        if (self.kind, kind) == ("q4", "q5"):
            return QuantizedWeight("q5", self.values(), self.d, self.m, self.ggml_type)
        if kind != "q6m":
            raise ValueError(f"cannot widen {self.kind} to {kind}")
        per_16 = self.kind in _PER_16
        d = self.d if per_16 else self.d.repeat_interleave(2, dim=1)
        m = torch.zeros_like(d) if self.m is None else self.m if per_16 else self.m.repeat_interleave(2, dim=1)
        return QuantizedWeight("q6m", self.values().view(torch.int8), d, m, self.ggml_type)
