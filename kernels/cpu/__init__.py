"""Harpoon's CPU kernels in C (``*.c`` here and under ``arch/``), built for this CPU and loaded with ctypes
(``library.py``), and their Python side, one module a job:

- ``formats.py``: the table of formats of packed weights;
- ``packing.py``: weights into panels of those formats (``blocks.py``: the block formats' reference packers);
- ``bodies.py``: which product bodies this build and CPU have, and which one runs;
- ``ops.py``: the kernels as functions of torch tensors;
- ``decoder.py``: a whole decode step in one call; ``pages.py``: memory for panels.

This package's namespace holds them all, as the engine calls them (``cpu_kernels.linear``, ...).
"""

from kernels.cpu.bodies import (
    BF16_DOTS,
    DEFAULT_BODY,
    F32_BODIES,
    Q8X_DOTS,
    Body,
    bf16_dots,
    f32_bodies,
    panel_width,
    q8x_available,
    q8x_dots,
    q8x_tiles_available,
    register_rows,
)
from kernels.cpu.formats import (
    BY_NAME,
    COMPACT_DTYPES,
    FORMAT_NAMES,
    FORMATS,
    HP_Q8X,
    TILE_WIDTH,
    WEIGHT_FORMATS,
    WIDENED_TILE_BYTES,
    PanelFormat,
    format_of,
    gguf_format,
    packed_geometry,
)
from kernels.cpu.library import available, library
from kernels.cpu.ops import (
    KV_FORMATS,
    add_rms_norm,
    apply_token_bitmask,
    argmax_linear,
    check,
    embed_rows,
    kv_format,
    linear,
    linear_int8,
    paged_decode_attention,
    product_word,
    q8x_rounding_error,
    rms_norm,
    rotary_,
    row_norms,
    screened_argmax,
    shm_sum,
    shm_sum_bytes,
    silu_mul,
    store_kv,
    widen_panels,
)
from kernels.cpu.packing import (
    as_split,
    bf16_panels_enabled,
    int8_rows,
    pack_blocks,
    pack_gguf,
    pack_gguf_ksplit,
    pack_gguf_rows,
    pack_gguf_widened,
    pack_weight,
    pack_weight_bf16a,
    pack_weight_bf16c,
    pack_weight_blocks,
    pack_weight_compact,
    pack_weight_int8,
    pack_weight_q4a,
    pack_weight_q6a,
    pack_weight_q8a,
    panel_layout,
)

__all__ = [
    "BF16_DOTS", "BY_NAME", "COMPACT_DTYPES", "DEFAULT_BODY", "F32_BODIES", "FORMATS", "FORMAT_NAMES", "HP_Q8X",
    "KV_FORMATS", "Q8X_DOTS", "Body", "TILE_WIDTH", "WEIGHT_FORMATS", "WIDENED_TILE_BYTES", "PanelFormat",
    "add_rms_norm", "apply_token_bitmask", "argmax_linear", "as_split", "available", "bf16_dots", "bf16_panels_enabled",
    "check", "embed_rows", "f32_bodies", "format_of", "gguf_format", "int8_rows", "kv_format", "library", "linear",
    "linear_int8", "pack_blocks", "pack_gguf", "pack_gguf_ksplit", "pack_gguf_rows", "pack_gguf_widened",
    "pack_weight", "pack_weight_bf16a", "pack_weight_bf16c", "pack_weight_blocks", "pack_weight_compact",
    "pack_weight_int8", "pack_weight_q4a", "pack_weight_q6a", "pack_weight_q8a", "packed_geometry",
    "paged_decode_attention", "panel_layout", "panel_width", "product_word", "q8x_available", "q8x_dots",
    "q8x_rounding_error", "q8x_tiles_available", "register_rows", "rms_norm", "rotary_", "row_norms", "screened_argmax",
    "shm_sum", "shm_sum_bytes", "silu_mul", "store_kv",
    "widen_panels",
]
