"""The bodies this build and CPU have for each kind of product, and ``Body``: the ones a product runs through.

A kind of product may have several bodies: the bfloat16 products (the FMAs, avx512_bf16's dot product, AMX tiles),
the fp32 products of many rows (one panel at a time, or whole pairs), the int8-activation products (VNNI's or
maddubs' dot product, and AMX tiles from some number of rows on). Start-up times them on the machine at hand
(``engine/backends/cpu.py``, ``engine/kernel_plan.py``) and the chosen ones travel with every call, as bits of the
product word (ops.h): no state of the process says how a product runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kernels.cpu.library import library


def panel_width() -> int:
    """Output columns per panel (NR in panels.h)."""
    return library().hp_panel_width()


def register_rows() -> int:
    """The most rows a product over compact panels computes without widening them into fp32 first (MRF)."""
    return library().hp_register_rows()


# The bodies of each kind, by name: the enums of ops.h (hp_bf16_dot, hp_f32_body, hp_q8x_dot)
BF16_DOTS = {"fma": 0, "dpbf16": 1, "amx": 2}
F32_BODIES = {"panels": 0, "pairs": 1}
Q8X_DOTS = {"vnni": 0, "maddubs": 1}
# Where each kind's field sits in a product word (ops.h: HP_BF16_BODY_AT ...), and the tile rows' field
_FIELD_AT = {"bf16": (9, BF16_DOTS), "f32": (11, F32_BODIES), "int8_dot": (13, Q8X_DOTS)}
_TILE_ROWS_AT, _MAX_TILE_ROWS = 16, 255


def _bodies(found: int, codes: dict[str, int]) -> list[str]:
    """The names of ``codes`` whose bit is set in ``found``, the library's mask of the bodies it has."""
    return [name for name, code in codes.items() if found & 1 << code]


def bf16_dots() -> list[str]:
    """The bodies this build and CPU can compute BF16C panels with: the portable FMAs always; avx512_bf16's dot
    product (the same bits) and AMX tiles (their own bits) where present."""
    return _bodies(library().hp_bf16_dots(), BF16_DOTS)


def f32_bodies() -> list[str]:
    """The bodies this build has for fp32 products of more than ``register_rows()`` rows, all with the same bits:
    each 24-column panel on its own (one 16-lane and one 8-lane FMA a row and k) and, where built for AVX-512,
    whole panels two at a time (three 16-lane FMAs)."""
    return _bodies(library().hp_f32_bodies(), F32_BODIES)


def q8x_available() -> bool:
    """Whether this CPU multiplies block panels with int8 activations (``linear(..., int8_activations=True)``): it
    has integer dot products (AVX512-VNNI or AVX-VNNI, or AVX2's maddubs)."""
    return bool(library().hp_q8x_available())


def q8x_dots() -> list[str]:
    """The integer dot products this build has for int8-activation products (``Q8X_DOTS``)."""
    return _bodies(library().hp_q8x_dots(), Q8X_DOTS)


def q8x_tiles_available() -> bool:
    """Whether AMX tiles can take the int8-activation products (this build and CPU have AMX-INT8, and the kernel
    lets the process use the tiles): the same bits as the dot products, 16 rows a tile op."""
    return bool(library().hp_q8x_tiles_available())


_AVAILABLE = {"bf16": bf16_dots, "f32": f32_bodies, "int8_dot": q8x_dots}


@dataclass(frozen=True)
class Body:
    """The bodies a product runs through: for each kind a name of that kind's table, or None for this build's
    default (avx512_bf16's dot where built, else the FMAs; pairs where built; VNNI where built, else maddubs), and
    from how many rows AMX tiles take the int8 products (0: never). Checked against what this build and CPU have
    when made, so a product never names a body it lacks."""

    bf16: str | None = None
    f32: str | None = None
    int8_dot: str | None = None
    int8_tile_rows: int = 0

    def __post_init__(self) -> None:
        for kind, available in _AVAILABLE.items():
            name = getattr(self, kind)
            if name is not None and name not in available():
                raise ValueError(f"this build has no {name!r} {kind} body (it has {available()})")
        if not 0 <= self.int8_tile_rows <= _MAX_TILE_ROWS or (self.int8_tile_rows and not q8x_tiles_available()):
            raise ValueError(f"no AMX tiles for the int8 products from {self.int8_tile_rows} rows here")

    def word(self) -> int:
        """The body's bits of a product word (ops.h), to be or-ed with the format's code."""
        bits = self.int8_tile_rows << _TILE_ROWS_AT
        for kind, (at, codes) in _FIELD_AT.items():
            name = getattr(self, kind)
            bits |= 0 if name is None else (1 + codes[name]) << at
        return bits

    def describe(self) -> str:
        """Its fields that differ from the defaults, as ``kind=name``; ``default`` where none."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default]
        return ", ".join(parts) or "default"


DEFAULT_BODY = Body()
