"""The C kernels as functions of torch tensors: each checks its arguments (a ValueError naming the one that does
not fit) and calls its kernel of ops.h: the products of packed weights, the reads of their rows, the LM head's
screen, paged decode attention, the per-layer row operations and the KV store.
"""

from __future__ import annotations

import torch

from kernels import cdiv, kv_int8
from kernels.cpu.bodies import DEFAULT_BODY, Body, panel_width
from kernels.cpu.formats import FORMAT_NAMES, HP_Q8X, WEIGHT_FORMATS, format_of, packed_geometry
from kernels.cpu.library import library
from kernels.cpu.pages import advise_huge_pages


def check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU {dtype} tensor, got {t.dtype} on {t.device}")


def _check_tokens(t: torch.Tensor, name: str) -> None:
    """``t`` [tokens, heads, head_dim], fp32 on the CPU, with the heads of a token contiguous (any token stride)."""
    check(t, torch.float32, name)
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name}: the heads of a token must be contiguous, got strides {t.stride()}")


# enum hp_kv_format (ops.h) of each K/V pool dtype; an int8 pool's rows are kernels/kv_int8.py's
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def kv_format(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int | None = None) -> int:
    """The C kernels' code for a pair of K/V pools, which must be contiguous CPU tensors of one supported dtype (and,
    given ``head_dim``, rows of that many values)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in KV_FORMATS or t.dtype != k_cache.dtype or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous CPU pool of float32, bfloat16 or int8 like k_cache, got "
                             f"{t.dtype} on {t.device}")
        if head_dim is not None and t.shape[-1] != kv_int8.row_width(head_dim, t.dtype):
            raise ValueError(f"{name}: rows of {t.shape[-1]} elements do not hold a {t.dtype} head of {head_dim}")
    return KV_FORMATS[k_cache.dtype]


def _fitting_rows(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x`` as fp32 rows (``_rows``) that ``packed``'s panels take, which hold at least ``out_features`` columns."""
    x = _rows(x, "x")
    in_features, columns = packed_geometry(packed)
    if in_features != x.shape[1] or columns < out_features:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)} -> {out_features}")
    return x


def product_word(packed: torch.Tensor, int8_activations: bool = False, body: Body = DEFAULT_BODY) -> int:
    """The word that names a product over ``packed``'s panels (ops.h): their format, the int8-activation flag, the
    body."""
    return WEIGHT_FORMATS[packed.dtype] | (HP_Q8X if int8_activations else 0) | body.word()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           int8_activations: bool = False, out: torch.Tensor | None = None, body: Body = DEFAULT_BODY) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 ``x`` [M, K] (rows may be strided) and ``packed = pack_weight(weight)`` or
    ``pack_weight_compact(weight)``. ``int8_activations``: block panels (a GGUF file's) multiply ``x`` rounded to
    int8 per 32 inputs, as llama.cpp does, where ``q8x_available()`` (not exact: see ops.c); other panels ignore
    it. ``out``: where to write it, fp32 [M, out_features] with rows that may be strided (some columns of a wider
    output). ``body``: the bodies the product runs through (``bodies.Body``; this build's defaults)."""
    x = _fitting_rows(x, packed, out_features)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32) if out is None else out
    check(y, torch.float32, "out")
    if y.shape != (m, out_features) or (m and out_features > 1 and y.stride(1) != 1):
        raise ValueError(f"out: expected [{m}, {out_features}] with contiguous rows, got {tuple(y.shape)} "
                         f"strides {y.stride()}")
    b = 0 if bias is None else bias.contiguous().data_ptr()
    if m:
        fmt = product_word(packed, int8_activations, body)
        library().hp_linear_packed(fmt, x.data_ptr(), x.stride(0), packed.data_ptr(), b, y.data_ptr(), y.stride(0),
                                    m, out_features, k)
    return y


def argmax_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  body: Body = DEFAULT_BODY) -> torch.Tensor | None:
    """``linear(x, packed, out_features).argmax(-1)`` (the first of equal maxima, a NaN the largest) [M] int64,
    from the same products without writing them, where AMX computes ``packed``'s format; else None."""
    x = _fitting_rows(x, packed, out_features)
    m, k = x.shape
    ids = torch.empty(m, dtype=torch.int64)
    word = product_word(packed, body=body)
    found = library().hp_argmax_packed(word, x.data_ptr(), x.stride(0), packed.data_ptr(), m, out_features, k,
                                        ids.data_ptr())
    return ids if found == 0 else None


def embed_rows(packed: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``weight[ids]`` [len(ids), K] fp32, read from ``packed``, the panels of ``weight`` [num_rows, K] in any
    format ``linear`` takes, so an embedding table tied to a packed LM head needs no row-major copy. Q4A, Q6A and
    Q8A panels give the fp32 values their tiles round to bfloat16, as Q4S, Q6S and Q8S panels (the same bytes) do."""
    in_features = _inputs_of_rows(packed, num_rows)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
    bad = library().hp_embed_rows(WEIGHT_FORMATS[packed.dtype], packed.data_ptr(), num_rows, in_features,
                                   ids.data_ptr(), ids.shape[0], out.data_ptr())
    if bad >= 0:
        raise IndexError(f"token id {int(ids[bad])} is out of range for an embedding of {num_rows} rows")
    return out


def _inputs_of_rows(packed: torch.Tensor, num_rows: int) -> int:
    """The inputs (K) of each of a packed weight's rows; ValueError where its panels hold fewer than ``num_rows``."""
    in_features, columns = packed_geometry(packed)
    if columns < num_rows:
        raise ValueError(f"packed weight {tuple(packed.shape)} holds {columns} rows, not {num_rows}")
    return in_features


def row_norms(packed: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``weight.double().norm(dim=1)`` [num_rows] float64, read from ``packed``, the fp32, BF16 or block panels of
    ``weight`` [num_rows, K]: the fp32 values the products use, each panel unpacked once (the LM head's int8 screen
    needs every row's norm, ``engine/backends/greedy_head.py``)."""
    in_features = _inputs_of_rows(packed, num_rows)
    out = torch.empty(num_rows, dtype=torch.float64)
    if library().hp_row_norms(WEIGHT_FORMATS[packed.dtype], packed.data_ptr(), num_rows, in_features,
                               out.data_ptr()):
        raise ValueError(f"row norms do not read {FORMAT_NAMES.get(packed.dtype, packed.dtype)} panels")
    return out


def widen_panels(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 panels (``pack_weight``'s layout) of a weight held as BF16 or block panels: the values the products
    unpack from those, so ``linear`` over either gives the same bits; in fresh memory on huge pages, outside any
    panel arena (they are never a panel cache's)."""
    in_features, columns = packed_geometry(packed)
    out = torch.empty(columns // panel_width(), in_features, panel_width(), dtype=torch.float32)
    advise_huge_pages(out.data_ptr(), out.nbytes)
    if library().hp_widen_panels(WEIGHT_FORMATS[packed.dtype], packed.data_ptr(), columns, in_features,
                                  out.data_ptr()):
        name = FORMAT_NAMES.get(packed.dtype, packed.dtype)
        raise ValueError(f"widen_panels takes compact panels (BF16 or blocks), not {name}")
    return out


def linear_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """Approximately ``x @ weight.T`` for fp32 ``x`` [M, K] and ``packed, scales = pack_weight_int8(weight)``."""
    x = _rows(x, "x")
    m, k = x.shape
    if packed.dtype != torch.int8 or packed.shape[1] * 4 != k or scales.numel() < out_features:
        raise ValueError(f"int8 weight {tuple(packed.shape)} does not fit x {tuple(x.shape)} -> {out_features}")
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        library().hp_linear_i8(
            x.data_ptr(), x.stride(0), packed.data_ptr(), scales.data_ptr(), y.data_ptr(), out_features, m,
            out_features, k,
        )
    return y


def q8x_rounding_error(x: torch.Tensor) -> torch.Tensor:
    """[M] float64, at least ||x_m - x^_m|| for each row of fp32 ``x`` [M, K] (K % 32 == 0), x^ being x as the
    int8-activation products (``linear(..., int8_activations=True)``) round it."""
    x = _rows(x, "x")
    m, k = x.shape
    if k % 32:
        raise ValueError(f"q8x_rounding_error: K = {k} is not a multiple of 32")
    err = torch.empty(m, dtype=torch.float64)
    if m:
        library().hp_q8x_rounding_error(x.data_ptr(), x.stride(0), m, k, err.data_ptr())
    return err


def screened_argmax(
    hidden: torch.Tensor, approx: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, max_candidates: int,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row m of ``hidden`` [M, K], the argmax of ``linear(hidden, packed, N)`` given ``approx`` [M, N] within
    ``s_m error`` [N] (float64) of it, where s_m is ``row_scale`` [M] (float64) or ||h_m||: the columns that may hold
    the largest logit are recomputed exactly from ``packed`` (fp32 or block panels, as ``linear`` takes them, but
    not BF16C or widened ones). Returns [M] int64, -1 in a row with more than ``max_candidates`` of them or a value
    that is not finite."""
    hidden = _rows(hidden, "hidden")
    check(approx, torch.float32, "approx")
    check(error, torch.float64, "error")
    m, n = approx.shape
    k = hidden.shape[1]
    in_features, columns = packed_geometry(packed)
    if format_of(packed).products != "exact":
        raise ValueError(f"screened_argmax cannot recompute columns of {format_of(packed).name} panels")
    if (hidden.shape[0] != m or error.shape != (n,) or not approx.is_contiguous() or in_features != k
            or columns < n or (row_scale is not None and row_scale.shape != (m,))):
        raise ValueError(f"screened_argmax: hidden {tuple(hidden.shape)}, approx {tuple(approx.shape)}, error "
                         f"{tuple(error.shape)}, packed {tuple(packed.shape)} do not match")
    if row_scale is not None:
        check(row_scale, torch.float64, "row_scale")
    tokens = torch.empty(m, dtype=torch.int64)
    library().hp_screened_argmax(hidden.data_ptr(), hidden.stride(0), m, k, approx.data_ptr(), error.data_ptr(),
                                  None if row_scale is None else row_scale.data_ptr(), WEIGHT_FORMATS[packed.dtype],
                                  packed.data_ptr(), n, max_candidates, tokens.data_ptr())
    return tokens


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], any token stride, contiguous inside a token
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written in place
) -> None:
    _check_tokens(q, "q")
    _check_tokens(out, "out")
    check(block_tables, torch.int32, "block_tables")
    check(seq_lens, torch.int32, "seq_lens")
    num_seqs, num_heads, head_dim = q.shape
    fmt = kv_format(k_cache, v_cache, head_dim)
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
    library().hp_paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        fmt,
    )


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as fp32 rows that are contiguous inside (any row stride)."""
    check(x, torch.float32, name)
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` [..., D] into a new contiguous tensor."""
    rows = _rows(x.reshape(-1, x.shape[-1]), "x")
    out = torch.empty(x.shape, dtype=torch.float32)
    library().hp_rms_norm(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], eps
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then returns RMSNorm(residual); both [M, D] contiguous."""
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("add_rms_norm needs contiguous x and residual")
    out = torch.empty(x.shape, dtype=torch.float32)
    library().hp_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps
    )
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on ``x`` [T, heads, head_dim] (heads contiguous, any token stride)."""
    _check_tokens(x, "x")
    t, heads, head_dim = x.shape
    check(positions, torch.int64, "positions")
    library().hp_rotary(
        x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads, head_dim
    )


def shm_sum_bytes(ranks: int, slot: int) -> int:
    """The shared segment ``shm_sum`` needs for ``ranks`` ranks summing up to ``slot`` floats a call."""
    return library().hp_shm_sum_bytes(ranks, slot)


def shm_sum(base: int, rank: int, ranks: int, slot: int, x: torch.Tensor, generation: int, timeout_s: float) -> bool:
    """x (contiguous fp32, at most ``slot`` elements) summed in place across the ranks through the shared segment at
    address ``base`` (``shm_sum.c``); False if a rank had not arrived within ``timeout_s`` (call again to go on
    waiting)."""
    check(x, torch.float32, "x")
    return library().hp_shm_sum(base, rank, ranks, slot, x.data_ptr(), x.numel(), generation, timeout_s) == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [M, 2I] -> [M, I]."""
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    library().hp_silu_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear; logits [B, vocab] fp32 with unit column
    stride, rows [R] int64, bitmask [R, ceil(vocab / 32)] int32 (xgrammar's layout)."""
    check(logits, torch.float32, "logits")
    check(rows, torch.int64, "rows")
    check(bitmask, torch.int32, "bitmask")
    batch, vocab = logits.shape
    if logits.stride(1) != 1 or bitmask.shape != (rows.numel(), cdiv(vocab, 32)):
        raise ValueError(f"apply_token_bitmask: logits {tuple(logits.shape)} (strides {logits.stride()}), "
                         f"rows {tuple(rows.shape)} and bitmask {tuple(bitmask.shape)} do not fit")
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < batch:
        raise ValueError(f"apply_token_bitmask: rows out of range [0, {batch})")
    rows, bitmask = rows.contiguous(), bitmask.contiguous()
    library().hp_apply_token_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), bitmask.data_ptr(),
                                      rows.numel(), bitmask.shape[1], vocab)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k, v [T, kv_heads, head_dim] (heads contiguous, any token stride) into their int64 cache slots."""
    _check_tokens(k, "k")
    _check_tokens(v, "v")
    t, heads, head_dim = k.shape
    check(slot_mapping, torch.int64, "slot_mapping")
    fmt = kv_format(k_cache, v_cache, head_dim)
    library().hp_store_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        t,
        heads,
        head_dim,
        fmt,
    )
