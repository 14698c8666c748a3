"""The table of formats of packed weights: one ``PanelFormat`` per layout the C kernels read (``enum
hp_weight_format`` in ops.h), with what every reader of a format asks of it: its code, the bytes of its blocks, how
its products compute, which GGUF block types are packed into it. The role of ggml's ``type_traits_cpu[]``: the
packers (``packing.py``, ``blocks.py``, ``gguf_pack.c``), the kernels' Python side, the backends, the memory ledger
and the tests read this table rather than keep lists of their own.

A packed weight is a torch tensor ``[panels, blocks along K, bytes of a block / itemsize]`` whose dtype is its
format's ``tag``: torch has no dtypes of a library's making, so each format borrows one that no other format uses,
and ``format_of`` reads it back. A tag says nothing of the values (a Q4K panel's uint16 are bytes of its layout).

    name   products    inputs/block  bytes/column/block  GGUF blocks packed into it
    F32    exact       1             4
    BF16   exact       1             2                   (a bfloat16 checkpoint loaded as fp32)
    Q4     exact       32            24                  Q4_0, Q4_1
    Q8     exact       32            36                  Q5_0, Q8_0
    Q5     exact       32            40                  Q5_1
    Q6M    exact       32            48                  (a fused projection of mixed types)
    Q4K    exact       256           144                 Q4_K
    Q5K    exact       256           272                 Q5_K
    Q6K    exact       256           212                 Q6_K
    BF16C  bfloat16    1             2
    BF16A  tiles       1             2
    Q4A    tiles       32            24                  Q4_0, Q4_1, Q4_K
    Q6A    tiles       32            32                  Q6_K
    Q8A    tiles       32            36                  Q5_0, Q8_0
    Q4S    tiles-fp32  32            24                  (Q4A's bytes)
    Q6S    tiles-fp32  32            32                  (Q6A's bytes)
    Q8S    tiles-fp32  32            36                  (Q8A's bytes)
    Q4KS   tiles-fp32  256           148                 Q4_K
    Q6KS   tiles-fp32  256           210                 Q6_K

(Code 1 of the enum, the LM head screen's int8 panels with a scale per column, is read through ``linear_int8``
alone, with its scales beside it: no packed weight of the table.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu.bodies import panel_width

GROUP, SUPER = 32, 256  # inputs of a block (Q4_GROUP and Q8_GROUP in panels.h, as GGUF's), of a K-quant super-block
TILE_WIDTH = 32  # columns of a panel of the AMX formats: two whole tiles of 16 (HP_BF16A_WIDTH in ops.h)
HP_Q8X = 256  # ops.h: the flag on a format's code that asks for int8 activations
# ggml's type ids (gguf-py's GGMLQuantizationType) that the table names
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14


@dataclass(frozen=True)
class PanelFormat:
    """One format of packed weights.

    ``inputs``: the inputs (k) one block of a panel holds, the packed tensor's dim 1 counting blocks (1: each k).
    ``column_bytes``: the bytes one column of a panel takes in one block (a block of a panel ``width`` columns wide
    is ``width * column_bytes`` bytes). ``tiles``: its panels are TILE_WIDTH columns (AMX's layouts), else the
    kernels' panel width. ``products``: how its products compute: ``exact`` (fp32's bits, the same from every exact
    format of the same weights), ``bfloat16`` (the activations rounded to bfloat16, the products summed in fp32),
    ``tiles`` (bfloat16 on AMX tiles), ``tiles-fp32`` (fp32's accuracy on AMX tiles). ``compact``: fp32's values in
    fewer bytes, widened to fp32 as the products read them (``widen_panels`` gives the fp32 panels). ``kind``: the name
    ``engine/models/quantized.py`` gives blocks packed into it. ``gguf``: the ggml types whose blocks are packed into
    it as they lie in the file. ``same_bytes_as``: the format whose bytes these are, multiplied another way."""

    name: str
    code: int
    tag: torch.dtype
    inputs: int
    column_bytes: int
    products: str
    tiles: bool = False
    compact: bool = False
    kind: str | None = None
    gguf: tuple[int, ...] = ()
    same_bytes_as: str | None = None

    def width(self, panel_width: int) -> int:
        """Columns a panel holds, given the kernels' panel width (``panel_width()``)."""
        return TILE_WIDTH if self.tiles else panel_width

    def block_bytes(self, panel_width: int) -> int:
        """Bytes of one block of one panel."""
        return self.width(panel_width) * self.column_bytes

    def tile_bytes(self) -> int:
        """Bytes of one AMX tile of 16 columns in one block (the AMX formats')."""
        assert self.tiles, f"{self.name} panels have no tiles"
        return 16 * self.column_bytes


FORMATS = (
    PanelFormat("F32", 0, torch.float32, 1, 4, "exact"),
    PanelFormat("Q4", 2, torch.uint8, GROUP, 24, "exact", compact=True, kind="q4", gguf=(Q4_0, Q4_1)),
    PanelFormat("BF16", 3, torch.bfloat16, 1, 2, "exact", compact=True),
    PanelFormat("Q8", 4, torch.int8, GROUP, 36, "exact", compact=True, kind="q8", gguf=(Q5_0, Q8_0)),
    PanelFormat("BF16C", 5, torch.int16, 1, 2, "bfloat16"),
    PanelFormat("Q5", 6, torch.int32, GROUP, 40, "exact", compact=True, kind="q5", gguf=(Q5_1,)),
    PanelFormat("Q6M", 8, torch.float64, GROUP, 48, "exact", compact=True, kind="q6m"),
    PanelFormat("Q4K", 9, torch.uint16, SUPER, 144, "exact", compact=True, kind="q4k", gguf=(Q4_K,)),
    PanelFormat("Q5K", 10, torch.uint32, SUPER, 272, "exact", compact=True, kind="q5k", gguf=(Q5_K,)),
    PanelFormat("Q6K", 11, torch.uint64, SUPER, 212, "exact", compact=True, kind="q6k", gguf=(Q6_K,)),
    PanelFormat("BF16A", 12, torch.float16, 1, 2, "tiles", tiles=True),
    PanelFormat("Q4A", 13, torch.float8_e4m3fn, GROUP, 24, "tiles", tiles=True, gguf=(Q4_0, Q4_1, Q4_K)),
    PanelFormat("Q6A", 14, torch.float8_e5m2, GROUP, 32, "tiles", tiles=True, gguf=(Q6_K,)),
    PanelFormat("Q8A", 15, torch.float8_e4m3fnuz, GROUP, 36, "tiles", tiles=True, gguf=(Q8_0, Q5_0)),
    PanelFormat("Q4S", 16, torch.float8_e5m2fnuz, GROUP, 24, "tiles-fp32", tiles=True, same_bytes_as="Q4A"),
    PanelFormat("Q6S", 17, torch.float4_e2m1fn_x2, GROUP, 32, "tiles-fp32", tiles=True, same_bytes_as="Q6A"),
    PanelFormat("Q8S", 18, torch.float8_e8m0fnu, GROUP, 36, "tiles-fp32", tiles=True, same_bytes_as="Q8A"),
    PanelFormat("Q4KS", 19, torch.bits4x2, SUPER, 148, "tiles-fp32", tiles=True, gguf=(Q4_K,)),
    PanelFormat("Q6KS", 20, torch.bits8, SUPER, 210, "tiles-fp32", tiles=True, gguf=(Q6_K,)),
)
BY_NAME = {f.name: f for f in FORMATS}
BY_TAG = {f.tag: f for f in FORMATS}
assert len(BY_NAME) == len(BY_TAG) == len({f.code for f in FORMATS}) == len(FORMATS), "one row a format"


def format_of(packed: torch.Tensor) -> PanelFormat:
    """The format of a packed weight, read from its tag; ValueError for a tensor that is no packed weight."""
    found = BY_TAG.get(packed.dtype)
    if found is None:
        raise ValueError(f"expected packed panels of {', '.join(f.name for f in FORMATS)}, got {packed.dtype}")
    return found


def packed_geometry(packed: torch.Tensor) -> tuple[int, int]:
    """(in_features, output columns held) of a packed weight of any format of the table; ValueError where its shape
    is not a whole number of its format's panels and blocks."""
    fmt = format_of(packed)
    if packed.dim() != 3:
        raise ValueError(f"expected packed panels [panels, blocks, bytes of a block], got {fmt.name}'s tag "
                         f"{packed.dtype} in {tuple(packed.shape)}")
    expected = fmt.block_bytes(panel_width())
    if packed.shape[2] * packed.element_size() != expected:
        raise ValueError(f"{fmt.name} panels hold {expected} bytes per {fmt.inputs} inputs, got {tuple(packed.shape)} "
                         f"{packed.dtype}")
    return packed.shape[1] * fmt.inputs, packed.shape[0] * fmt.width(panel_width())


def gguf_format(ggml_type: int, products: str) -> PanelFormat | None:
    """The format a GGUF file's blocks of ``ggml_type`` are packed into for products computed so (``exact``,
    ``tiles`` or ``tiles-fp32``), or None where none holds them."""
    return next((f for f in FORMATS if ggml_type in f.gguf and f.products == products), None)


def split_of(widened: PanelFormat) -> PanelFormat:
    """The tiles-fp32 format with ``widened``'s bytes (Q4A -> Q4S ...)."""
    return next(f for f in FORMATS if f.same_bytes_as == widened.name)


# The table's columns as the kernels' Python side looks them up (each derived from FORMATS, none kept by hand)
WEIGHT_FORMATS = {f.tag: f.code for f in FORMATS}
FORMAT_NAMES = {f.tag: f.name for f in FORMATS}
COMPACT_DTYPES = frozenset(f.tag for f in FORMATS if f.compact)
WIDENED_TILE_BYTES = {f.tag: f.tile_bytes() for f in FORMATS if f.tiles and f.inputs == GROUP}
