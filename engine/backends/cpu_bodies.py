"""The bodies the CPU backend's products may run through, as choices start-up times (``engine/kernel_plan.py``).

Every body of a kind gives the same bits (avx512_bf16's dot product and the FMAs; VNNI's dot and maddubs and the
AMX-INT8 tiles; one fp32 panel at a time or whole pairs), except AMX's bfloat16 tiles, which sum in their own order:
which is fastest differs from machine to machine, so each is measured here rather than assumed from the CPU's flags.
The variants are the same kernel with another ``Body`` (``packed_linear.with_body``): nothing of the process is set
while they are timed.

NOTE: the bodies take turns (``best_in_turns``) and each keeps its best. Timed one after the other, once each, the
fp32 bodies on an AMD EPYC with AVX-512 read 4.01 / 1.35 ms (the first timed paid for the start) and 3.62 / 3.70 (the
machine slow for a moment): that server kept the body whose 64-client forward is 8-13% slower for its life.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from engine.backends.greedy_head import Int8ScreenedHead, screen_row_range
from engine.backends.packed_linear import PackedLinear, SplitLinear, with_body
from engine.kernel_plan import KernelChoice
from engine.timing import best_in_turns
from kernels import cpu as cpu_kernels
from kernels.cpu.moe import MoeBlock

# Rows at which the bfloat16 bodies are timed: a stream's decode, and batches of decodes or a prompt chunk. AMX tiles
# compute 16 rows at once, so they win from a few rows on; the sum weighs the batches, as throughput under load does.
BF16_ROWS = (1, 16, 64)
# Rows at which the fp32 bodies are timed: both run up to MRF rows alike (in registers), so batches and a chunk.
F32_ROWS = (16, 64)
INT8_ROWS = (1, 16)  # the int8 dot products: a stream's decode and a batch
Q8X_TILE_ROWS = (4, 16, 64)  # the row counts from which the AMX tiles may take the int8 products
MOE_ROWS = (1, 16)  # a mixture of experts' threads: a stream's decode step and a batch's
TIMING_TURNS = 4

Kernel = PackedLinear | SplitLinear
GetBody = Callable[[], cpu_kernels.Body]  # the body as chosen so far: each choice is timed against the earlier ones


def in_features(kernel: Kernel) -> int:
    return cpu_kernels.packed_geometry(kernel.parts[0].packed)[0]


def _calls(kernel: Kernel, body: GetBody, kind: str, names: list[str], rows: tuple[int, ...]) -> dict[str, Callable]:
    """One timed call of each body ``kind`` of ``names``: ``kernel``'s products at every count of ``rows``."""
    inputs, variants = [torch.randn(m, in_features(kernel)) for m in rows], {}

    def run(name: str) -> None:
        if name not in variants:  # made at the first call, the untimed one, from the body chosen by then
            variants[name] = with_body(kernel, replace(body(), **{kind: name}))
        for x in inputs:
            variants[name](x, None)

    return {name: partial(run, name) for name in names}


def bf16_choice(kernel: Kernel, body: GetBody) -> KernelChoice:
    """The body of the bfloat16 products: the FMAs, avx512_bf16's dot product, AMX tiles (whatever this CPU has)."""
    names = cpu_kernels.bf16_dots()
    return KernelChoice("bf16 body", _where(kernel, BF16_ROWS), _calls(kernel, body, "bf16", names, BF16_ROWS))


def f32_choice(kernel: Kernel, body: GetBody) -> KernelChoice:
    """The body of the fp32 products of many rows: one panel at a time, or whole pairs (AVX-512)."""
    names = cpu_kernels.f32_bodies()
    return KernelChoice("fp32 body", _where(kernel, F32_ROWS), _calls(kernel, body, "f32", names, F32_ROWS))


def int8_dot_choice(kernel: Kernel, body: GetBody) -> KernelChoice:
    """The integer dot product of the int8-activation products: VNNI's, or AVX2's maddubs."""
    names = cpu_kernels.q8x_dots()
    return KernelChoice("int8 dot", _where(kernel, INT8_ROWS), _calls(kernel, body, "int8_dot", names, INT8_ROWS))


def int8_tiles_choice(kernel: Kernel, body: GetBody) -> KernelChoice:
    """From how many rows on AMX tiles take the int8-activation products: the fewest of ``Q8X_TILE_ROWS`` from which,
    at that count and every larger one, the tiles were faster than the dot product chosen; 0 where they never were
    (the same bits either way). Measured rather than assumed: a tile op sums 16 rows at the cost of one, so a few
    rows leave most of it empty, and where that stops paying depends on the machine."""

    def measure() -> tuple[str, dict[str, float]]:
        chosen, seconds = 0, {}
        for rows in reversed(Q8X_TILE_ROWS):  # the most rows first: below the first loss nothing more is timed
            x = torch.randn(rows, in_features(kernel))
            variants = {name: with_body(kernel, replace(body(), int8_tile_rows=tiles))
                        for name, tiles in (("dot", 0), ("tiles", 1))}
            timed = best_in_turns({name: partial(v, x, None) for name, v in variants.items()}, turns=TIMING_TURNS - 1)
            seconds |= {f"{name}@{rows}": s for name, s in timed.items()}
            if timed["tiles"] >= timed["dot"]:
                break
            chosen = rows
        return str(chosen), seconds

    return KernelChoice("int8 tile rows", _where(kernel, Q8X_TILE_ROWS), measure=measure)


def screen_choice(screen: Int8ScreenedHead, body: GetBody) -> KernelChoice:
    """The batch sizes at which greedy steps take their tokens from the LM head's int8 screen rather than its exact
    product (``screen_row_range``): ``first-last`` rows, or ``none``."""

    def measure() -> tuple[str, dict[str, float]]:
        screen.body = body()
        (first, last), seconds = screen_row_range(screen)
        return (f"{first}-{last}" if last else "none"), seconds

    rows = f"{screen.vocab_size} x {screen.packed.shape[1] * 32}, the head from DRAM"
    return KernelChoice("int8 screen rows", rows, measure=measure)


def moe_split_choice(block: MoeBlock) -> KernelChoice:
    """How a mixture of experts' threads share a step's experts: each thread whole experts, or each product split
    across the threads (the same bits either way), timed on the first block at a stream's decode and a batch's."""
    def call(split: bool) -> Callable[[], object]:
        k, inputs = block.weights.top_k, []
        for rows in MOE_ROWS:
            experts = torch.stack([torch.randperm(block.num_experts)[:k] for _ in range(rows)])
            inputs.append((torch.randn(rows, block.hidden), experts, torch.full((rows, k), 1.0 / k)))

        def run() -> None:
            previous, block.split = block.split, split
            try:
                for x, experts, weights in inputs:
                    block.experts(x, experts, weights)
            finally:
                block.split = previous
        return run

    where = f"{block.num_experts} experts, {block.weights.top_k} a token, at {' + '.join(map(str, MOE_ROWS))} rows"
    return KernelChoice("moe threads", where, {"experts": call(True), "products": call(False)})


def _where(kernel: Kernel, rows: tuple[int, ...]) -> str:
    out_features = sum(part.out_features for part in kernel.parts)
    return f"{out_features} x {in_features(kernel)} at {' + '.join(map(str, rows))} rows"
