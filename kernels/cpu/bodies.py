"""Which bodies this build and CPU have for each kind of product, and which one runs: the kernels' panel width and
register rows, the bfloat16 bodies (FMAs, avx512_bf16, AMX tiles), the fp32 bodies of many rows (one panel or
pairs), the int8 dot products (VNNI, maddubs) and AMX tiles for them. The backend times them at start-up and sets
the fastest (``engine/backends/cpu.py``); the setters act for the whole process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kernels.cpu.library import library


def panel_width() -> int:
    """Output columns per panel (NR in ops.c)."""
    return library().hp_panel_width()


def register_rows() -> int:
    """The most rows a product over compact panels computes without widening them into fp32 first (MRF in ops.c)."""
    return library().hp_register_rows()


BF16_DOTS = {"fma": 0, "dpbf16": 1, "amx": 2}  # enum hp_bf16_dot (ops.h): the bodies that compute BF16C panels


def _bodies(found: int, codes: dict[str, int]) -> list[str]:
    """The names of ``codes`` whose bit is set in ``found``, the library's mask of the bodies it has."""
    return [name for name, code in codes.items() if found & 1 << code]


def _set_body(set_code: Callable[[int], int], codes: dict[str, int], name: str, what: str,
              available: Callable[[], list[str]]) -> str:
    """``name``'s code through the library's setter ``set_code`` (which answers the code before, or -1 where the
    build lacks it); the name of the body before."""
    before = set_code(codes.get(name, -1))
    if before < 0:
        raise ValueError(f"this build has no {name!r} {what} (it has {available()})")
    return next(n for n, code in codes.items() if code == before)


def bf16_dots() -> list[str]:
    """The bodies this build and CPU can compute BF16C panels with: the portable FMAs always; avx512_bf16's dot
    product (the same bits) and AMX tiles (their own bits) where present."""
    return _bodies(library().hp_bf16_dots(), BF16_DOTS)


def set_bf16_dot(name: str) -> str:
    """Which of ``bf16_dots()`` computes BF16C panels from now on, in every thread (the backend times them at
    start; one body for all products, so a row's bits do not depend on the batch). Returns the body before."""
    return _set_body(library().hp_set_bf16_dot, BF16_DOTS, name, "bfloat16 body", bf16_dots)


@contextmanager
def bf16_body(name: str) -> Iterator[None]:
    """``set_bf16_dot(name)`` for a ``with`` block, the body before it back after (timings, tests, benches)."""
    before = set_bf16_dot(name)
    try:
        yield
    finally:
        set_bf16_dot(before)


F32_BODIES = {"panels": 0, "pairs": 1}  # enum hp_f32_body (ops.c): the bodies of fp32 products from 5 rows on


def f32_bodies() -> list[str]:
    """The bodies this build has for fp32 products of 5 rows and more, all with the same bits: each 24-column panel
    on its own (one 16-lane and one 8-lane FMA a row and k) and, where built for AVX-512, whole panels two at a
    time (three 16-lane FMAs)."""
    return _bodies(library().hp_f32_bodies(), F32_BODIES)


def set_f32_body(name: str) -> str:
    """Which of ``f32_bodies()`` computes fp32 products from now on, in every thread (the backend times them at
    start). Returns the body before."""
    return _set_body(library().hp_set_f32_body, F32_BODIES, name, "fp32 body", f32_bodies)


def q8x_available() -> bool:
    """Whether this CPU multiplies block panels with int8 activations (``linear(..., int8_activations=True)``): it
    has integer dot products (AVX512-VNNI or AVX-VNNI, or AVX2's maddubs)."""
    return bool(library().hp_q8x_available())


Q8X_DOTS = {"vnni": 1, "maddubs": 2}  # ops.c: the integer dot products the int8-activation products can use


def q8x_dots() -> list[str]:
    """The integer dot products this build has for int8-activation products (``Q8X_DOTS``)."""
    found = library().hp_q8x_dots()
    return [name for name, bit in Q8X_DOTS.items() if found & bit]


def set_q8x_dot(name: str) -> None:
    """Which of ``q8x_dots()`` the int8-activation products use from now on (the backend times them at start)."""
    if library().hp_set_q8x_dot(Q8X_DOTS.get(name, 0)):
        raise ValueError(f"this build has no {name!r} dot product (it has {q8x_dots()})")


def q8x_tiles_available() -> bool:
    """Whether AMX tiles can take the int8-activation products (this build and CPU have AMX-INT8, and the kernel
    lets the process use the tiles): the same bits as the dot products, 16 rows a tile op."""
    return bool(library().hp_q8x_tiles_available())


def set_q8x_tile_rows(rows: int) -> None:
    """From how many rows on AMX tiles take the int8-activation products from now on (0: never; the backend
    times them at start)."""
    if library().hp_set_q8x_tile_rows(rows):
        raise ValueError(f"no AMX tiles for the int8 products here (rows={rows})")
