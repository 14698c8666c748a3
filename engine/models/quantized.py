"""A linear weight held as the integer blocks of a GGUF file, between the file and a backend's packed panels.

Why: an 8B model's weights in fp32 are 32 GB, more than the machines it must run on. Decoded from GGUF's bytes
into one of the row forms below, a weight keeps about the bytes its panels will take (0.6 to 1.25 a weight), and a
backend packs it layer by layer (``engine/backends/cpu.py``) or dequantizes it where its kernels need dense weights.

Every form reproduces gguf-py's dequantization: the scales are the products gguf-py forms (an fp16 d times a 6- or
8-bit sub-scale: at most 18 significant bits, exact in fp32), d q is then exact, and the one rounding is the add of
m, as gguf-py's. The K-quant kinds keep the file's super-block scales and sub-scales as they are (the kernels form
the products), which spares 0.16 bytes a weight over the per-32 forms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.cpu.pages import drop_pages

GROUP = 32  # inputs per block of every form
SUPER = 256  # inputs per super-block of the K-quant kinds

# kind -> what it holds and which GGUF types decode to it
KINDS = {
    "q4": "d q + m, q in 0..15 (nibbles), d and m per 32 inputs: Q4_0, Q4_1",
    "q8": "d q, q in -128..127, d per 32 inputs: Q8_0, Q5_0",
    "q5": "d q + m, q in 0..31, d and m per 32 inputs: Q5_1",
    "q6": "d q, q in -32..31, d per 16 inputs: a Q6_K's values with its scales formed (dequantized or widened)",
    "q6m": "d q + m, q a byte, d and m per 16 inputs: any kind, for a fused projection that mixes them",
    "q4k": "(d sc) q - (dmin mn), q in 0..15 (nibbles), d and dmin per 256 inputs, sc and mn per 32: Q4_K",
    "q5k": "as q4k with q in 0..31: Q5_K",
    "q6k": "(d sc) q, q in -32..31, d per 256 inputs, sc (int8) per 16: Q6_K",
}
_PER_16 = ("q6", "q6m")  # kinds with a d per 16 inputs
_WITH_M = ("q4", "q5", "q6m", "q4k", "q5k")
_K_QUANTS = {"q4k": "q4", "q5k": "q5", "q6k": "q6"}  # each with its per-32 (or per-16) kind of the same values


@dataclass
class QuantizedWeight:
    """A weight [N, K] (K % 32 == 0; K % 256 == 0 for the K-quant kinds) in one of ``KINDS``.

    q: q4, q4k: uint8 [N, K/32, 16], byte j of a block holding input j (low nibble) and j + 16 (high nibble);
       q5, q5k: uint8 [N, K/32, 32]; q6, q6k, q6m and q8: int8 [N, K/32, 32].
    d: fp32 [N, K/32] (q6, q6m: [N, K/16]; K-quants: [N, K/256]); m: like d for q4, q5, q6m, dmin for q4k and q5k,
    else None. sub: the K-quants' sub-scales: uint8 [N, K/32, 2] (sc, mn) for q4k and q5k, int8 [N, K/16] for q6k.
    ggml_type: the file's type name, for messages."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    ggml_type: str
    sub: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantized kind {self.kind!r}")
        n, groups = self.q.shape[:2]
        per = GROUP // 2 if self.kind in _PER_16 else SUPER if self.kind in _K_QUANTS else GROUP
        scales = (n, groups * GROUP // per)
        sub = {"q4k": (n, groups, 2), "q5k": (n, groups, 2), "q6k": (n, 2 * groups)}.get(self.kind)
        if (self.d.shape != scales or (self.m is None) == (self.kind in _WITH_M)
                or (self.m is not None and self.m.shape != scales)
                or (None if self.sub is None else tuple(self.sub.shape)) != sub):
            raise ValueError(f"{self.kind}: q {tuple(self.q.shape)}, d {tuple(self.d.shape)}, m and sub do not match")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m, self.sub) if t is not None)

    def values(self) -> torch.Tensor:
        """q as one integer per input: [N, K/32, 32], uint8 (q4, q4k, q5, q5k) or int8 (the others)."""
        if self.kind not in ("q4", "q4k"):
            return self.q
        return torch.cat([self.q & 15, self.q >> 4], dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K]: gguf-py's values in fp32, then cast to ``dtype``."""
        if self.kind in _K_QUANTS:
            return self.widen(_K_QUANTS[self.kind]).dequantize(dtype)
        n, k = self.shape
        q = self.values().float()
        if self.kind in _PER_16:
            q = q.view(n, -1, 2, 16)
        w = self.d.view(*q.shape[:-1], 1) * q
        if self.m is not None:
            w = w + self.m.view(*q.shape[:-1], 1)
        return w.reshape(n, k).to(dtype)

    def decoded(self) -> QuantizedWeight:
        return self

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of rows ``index`` (a reordering or a slice of the outputs)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return QuantizedWeight(self.kind, self.q[index], self.d[index], pick(self.m), self.ggml_type, pick(self.sub))

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """The weight of inputs ``start:stop`` (a tensor-parallel rank's part of a row-split projection). A K-quant
        cut inside its 256-input super-blocks is first expanded to its per-32 (per-16) kind, the same values."""
        if start % GROUP or stop % GROUP:
            raise ValueError(f"a {self.ggml_type} weight cannot be cut at inputs {start}:{stop} (blocks of {GROUP})")
        if self.kind in _K_QUANTS and (start % SUPER or stop % SUPER):
            return self._expanded().columns(start, stop)
        per = GROUP // 2 if self.kind in _PER_16 else SUPER if self.kind in _K_QUANTS else GROUP
        sub_per = GROUP // 2 if self.kind == "q6k" else GROUP
        cut = lambda t, n: None if t is None else t[:, start // n:stop // n]  # noqa: E731
        return QuantizedWeight(self.kind, cut(self.q, GROUP), cut(self.d, per), cut(self.m, per), self.ggml_type,
                               cut(self.sub, sub_per))

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights stacked along the outputs (a fused q/k/v or gate/up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            # NOTE: Q4_K_M files give attn_v more bits than attn_q and attn_k in some layers; the fused projection
            # then holds all of its rows in a kind wide enough for each.
            widened = {_K_QUANTS.get(k, k) for k in kinds}
            kind = widened.pop() if len(widened) == 1 else "q5" if widened <= {"q4", "q5"} else "q6m"
            parts = [p.widen(kind) for p in parts]
        first = parts[0]
        joined = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return QuantizedWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                               joined([p.m for p in parts]), "+".join(dict.fromkeys(p.ggml_type for p in parts)),
                               joined([p.sub for p in parts]))

    def widen(self, kind: str) -> QuantizedWeight:
        """The same values in a wider kind: a K-quant in its per-32 (per-16) kind, q4 -> q5, or any -> q6m."""
        if kind == self.kind:
            return self
        if self.kind in _K_QUANTS:
            return self._expanded().widen(kind)
        if (self.kind, kind) == ("q4", "q5"):
            return QuantizedWeight("q5", self.values(), self.d, self.m, self.ggml_type)
        if kind != "q6m":
            raise ValueError(f"cannot widen {self.kind} to {kind}")
        per_16 = self.kind in _PER_16
        d = self.d if per_16 else self.d.repeat_interleave(2, dim=1)
        m = torch.zeros_like(d) if self.m is None else self.m if per_16 else self.m.repeat_interleave(2, dim=1)
        return QuantizedWeight("q6m", self.values().view(torch.int8), d, m, self.ggml_type)

    def _expanded(self) -> QuantizedWeight:
        """A K-quant's values with the products of its scales formed (as gguf-py forms them) per 32 or 16 inputs."""
        n = self.q.shape[0]
        if self.kind == "q6k":
            d = (self.d.repeat_interleave(SUPER // 16, dim=1) * self.sub.float()).view(n, -1)
            return QuantizedWeight("q6", self.q, d, None, self.ggml_type)
        per = SUPER // GROUP
        d = self.d.repeat_interleave(per, dim=1) * self.sub[..., 0].float()
        m = -(self.m.repeat_interleave(per, dim=1) * self.sub[..., 1].float())
        return QuantizedWeight(_K_QUANTS[self.kind], self.q, d, m, self.ggml_type)


@dataclass(frozen=True)
class FileBlocks:
    """A weight's blocks still in a file's bytes (read-only views of its memory map), its rows in any order and from
    any of the views: what a backend packs straight from (``kernels.cpu.pack_gguf_rows``), or decodes into a
    ``QuantizedWeight`` where it needs one (``decoded``).

    Why: decoding every tensor as it is read, and packing the decoded rows after, took ~30 s for an 8B Q4_K_M file
    and held two copies of its largest tensor at once. Held like this, a weight costs nothing until it is packed,
    reordering its rows (llama.cpp's q/k interleave undone) or fusing q/k/v costs a list of row numbers, and its
    pages of the mapping are handed back once it is packed (``release``)."""

    ggml_type: str  # the file's type name, for messages
    type_id: int  # ggml's type number
    in_features: int
    sources: tuple[torch.Tensor, ...]  # uint8 [rows, bytes a row] each: a tensor of the file
    source: torch.Tensor  # int64 [N]: the view each output row is in
    row: torch.Tensor  # int64 [N]: its row there
    decoder: Callable[[torch.Tensor], QuantizedWeight]  # rows' bytes [n, bytes a row] -> their QuantizedWeight
    mapped: bool = False  # the views are of a file's read-only mapping, whose pages ``release`` may drop
    offsets: tuple[int, ...] = ()  # where each view begins in its file, where known (``file_positions``)

    @property
    def shape(self) -> tuple[int, int]:
        return self.row.shape[0], self.in_features

    def addresses(self) -> torch.Tensor:
        """Where each output row's first block lies in memory: int64 [N]."""
        return self._row_starts([t.data_ptr() for t in self.sources])

    def file_positions(self) -> torch.Tensor | None:
        """Where each output row's first block lies in the file: int64 [N]; None where a view's place is unknown.
        With the type and width, what the panels are made of (``engine/backends/panel_cache.py``'s key)."""
        return self._row_starts(self.offsets) if len(self.offsets) == len(self.sources) else None

    def _row_starts(self, view_starts: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Each output row's first block, where each view starts at ``view_starts``: int64 [N]."""
        starts = torch.tensor(view_starts, dtype=torch.int64)
        strides = torch.tensor([t.stride(0) for t in self.sources], dtype=torch.int64)
        return starts[self.source] + self.row * strides[self.source]

    def rows(self, index: torch.Tensor | slice) -> FileBlocks:
        return FileBlocks(self.ggml_type, self.type_id, self.in_features, self.sources, self.source[index],
                          self.row[index], self.decoder, self.mapped, self.offsets)

    @staticmethod
    def cat(parts: list[FileBlocks]) -> FileBlocks:
        """The weights stacked along the outputs; one type and width."""
        first = parts[0]
        if any(p.type_id != first.type_id or p.in_features != first.in_features for p in parts):
            raise ValueError(f"cannot stack {[p.ggml_type for p in parts]} rows as one type")
        sources: list[torch.Tensor] = []
        source = []
        for p in parts:
            source.append(p.source + len(sources))
            sources.extend(p.sources)
        known = all(len(p.offsets) == len(p.sources) for p in parts)
        offsets = tuple(o for p in parts for o in p.offsets) if known else ()
        return FileBlocks(first.ggml_type, first.type_id, first.in_features, tuple(sources), torch.cat(source),
                          torch.cat([p.row for p in parts]), first.decoder, all(p.mapped for p in parts), offsets)

    def decoded(self) -> QuantizedWeight:
        raw = torch.empty(self.shape[0], self.sources[0].shape[1], dtype=torch.uint8)
        for i, t in enumerate(self.sources):
            at = (self.source == i).nonzero().squeeze(1)
            raw[at] = t[self.row[at]]
        return self.decoder(raw)

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        return self.decoded().columns(start, stop)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.decoded().dequantize(dtype)

    def release(self) -> None:
        """Hand this process's pages of the views back (the page cache keeps them), once the weight is packed: the
        file is then never resident as a whole beside the packed weights. Nothing where the views are not of a
        file's mapping (dropping other memory's pages would zero it)."""
        if self.mapped:
            for t in self.sources:
                drop_pages(t.data_ptr(), t.numel())


@dataclass(frozen=True)
class SplitBlocks:
    """A fused projection whose shards come in two types (Q4_K_M's Q6_K attn_v after Q4_K q and k, in some
    layers): each run of one type is packed in its own panels, and multiplies into its own columns of the output.
    Why: stacked in one kind wide enough for both (q6m, 1.5 bytes a weight), an 8B model's q/k/v of those layers
    took 2.2x the bytes of the file's blocks, 330 MB more to hold and to read every token."""

    head: FileBlocks  # the first rows
    tail: FileBlocks  # the rest

    @property
    def shape(self) -> tuple[int, int]:
        return self.head.shape[0] + self.tail.shape[0], self.head.in_features

    @property
    def ggml_type(self) -> str:
        return f"{self.head.ggml_type}+{self.tail.ggml_type}"

    def decoded(self) -> QuantizedWeight:
        return QuantizedWeight.cat([self.head.decoded(), self.tail.decoded()])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([self.head.dequantize(dtype), self.tail.dequantize(dtype)])


Blocks = QuantizedWeight | FileBlocks | SplitBlocks  # a GGUF file's weight, decoded or not


def stack(parts: list[Blocks]) -> Blocks:
    """A fused projection's shards stacked: still in the file where all are one type, or two runs of one type each
    (``SplitBlocks``); else decoded and stacked in a kind wide enough for each (``QuantizedWeight.cat``)."""
    if all(isinstance(p, FileBlocks) for p in parts):
        runs = [[parts[0]]]
        for p in parts[1:]:
            if p.type_id == runs[-1][-1].type_id:
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) == 1:
            return FileBlocks.cat(parts)
        if len(runs) == 2:
            return SplitBlocks(FileBlocks.cat(runs[0]), FileBlocks.cat(runs[1]))
    return QuantizedWeight.cat([p.decoded() for p in parts])
