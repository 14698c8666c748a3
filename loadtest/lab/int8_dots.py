"""The int8-activation products (``--quantized-matmul int8``) on each integer dot product this CPU has: VNNI's
vpdpbusd, AVX2's maddubs, AMX tiles (``kernels/cpu/ops.c``, the Q8X products; all give the same bits), per GGUF
type and row count, the dots taking turns each round. Random blocks of realistic scales
(``loadtest.models.random_blocks``) in a model's real shapes, packed as the engine packs a file's blocks
(``pack_gguf_rows``), several copies of each weight so a product streams its panels from DRAM as a step does.
At one row a product reads its panels once and does little else: the GB/s of the panels it read, and their share of
the machine's read bandwidth measured first (a sum over 1 GiB on every thread), say how close to the memory it runs.

    python -m loadtest.lab.int8_dots --rows 1,4,16,64,128 --shapes 8192x2048,2048x8192 --types Q4_K,Q6_K,Q8_0
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from engine.backends.gemm_plan import cpu_isa
from engine.timing import seconds_per_call
from kernels import cpu
from loadtest.models import random_blocks


def packed_copies(kind: Q, n: int, k: int, copies: int) -> list[torch.Tensor]:
    """``copies`` of one random weight [n, k] of ``kind`` as the engine's block panels."""
    raw = torch.from_numpy(random_blocks(np.random.default_rng(0), n, k, kind))
    rows = raw.data_ptr() + torch.arange(n, dtype=torch.int64) * raw.shape[1]
    return [cpu.pack_gguf_rows(int(kind), rows, k) for _ in range(copies)]


def multiply_each(weights: list[torch.Tensor], x: torch.Tensor, n: int, body: cpu.Body) -> None:
    for weight in weights:
        cpu.linear(x, weight, n, int8_activations=True, body=body)


def read_bandwidth(rounds: int = 5) -> float:
    """Bytes/s of the fastest of ``rounds`` streaming reads of 1 GiB (torch's sum, every thread): the ceiling a
    one-row product's panel reads can approach."""
    x = torch.ones(1 << 28)
    x.sum()
    return x.numel() * 4 / min(seconds_per_call(x.sum, budget_s=0, rounds=1) for _ in range(rounds))


def body_of(dot: str) -> cpu.Body:
    """The products on ``dot``: a dot product, or "tiles" (AMX from one row on)."""
    return cpu.Body(int8_tile_rows=1) if dot == "tiles" else cpu.Body(int8_dot=dot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64,128")
    parser.add_argument("--shapes", default="8192x2048,2048x8192", help="N x K of each weight (Llama-3.2-1B's MLP)")
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    parser.add_argument("--copies", type=int, default=12, help="weights multiplied in turn, so none stays cached "
                        "(more than the last-level cache holds)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dots = cpu.q8x_dots() + (["tiles"] if cpu.q8x_tiles_available() else [])
    if not dots:
        raise SystemExit("this CPU has no integer dot products for int8 activations")
    peak = read_bandwidth()
    print(f"CPU: {cpu_isa()}; {torch.get_num_threads()} threads; read bandwidth {peak / 1e9:.1f} GB/s; ms a "
          f"product (the best of {args.rounds} rounds), GOP/s, and at one row the panels' GB/s and share of the "
          "read bandwidth\n")
    print(f"| type | N x K | rows | {' | '.join(dots)} |")
    print(f"|---|---|---|{'---|' * len(dots)}")
    for name in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            weights = packed_copies(Q[name], n, k, args.copies)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k)
                best = dict.fromkeys(dots, float("inf"))

                for _ in range(args.rounds):
                    for dot in dots:
                        call = partial(multiply_each, weights, x, n, body_of(dot))
                        best[dot] = min(best[dot], seconds_per_call(call) / args.copies)
                nbytes = weights[0].numel() * weights[0].element_size()
                cells = [f"{best[d] * 1e3:.2f} ({2 * m * n * k / best[d] / 1e9:.0f})"
                         + (f" {nbytes / best[d] / 1e9:.1f} GB/s = {nbytes / best[d] / peak:.0%}" if m == 1 else "")
                         for d in dots]
                print(f"| {name} | {n} x {k} | {m} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
