"""What keeping a K-quant's own scales costs the fp32 products on AMX tiles: Q4S against Q4KS panels of the same
Q4_K weight, and Q6S against Q6KS of a Q6_K one (``kernels/cpu/amx.c``; the same bits, 0.75 and 1 bytes a weight
against 0.58 and 0.82), per row count, alternating rounds. Random blocks of realistic scales
(``loadtest.models.random_blocks``), an 8B model's largest shapes by default, several copies of each weight so a
product streams its panels from DRAM as a step does.

    python -m loadtest.lab.split_formats --rows 1,4,16,64 --shapes 28672x4096,4096x14336
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

TYPES = {"Q4_K": Q.Q4_K, "Q6_K": Q.Q6_K}


def panels(kind: Q, n: int, k: int, copies: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``copies`` of one random weight [n, k] as its split panels (Q4S or Q6S) and its K-quant ones (Q4KS, Q6KS)."""
    raw = torch.from_numpy(random_blocks(np.random.default_rng(0), n, k, kind))
    rows = raw.data_ptr() + torch.arange(n, dtype=torch.int64) * raw.shape[1]
    split = [cpu.as_split(cpu.pack_gguf_widened(int(kind), rows, k)) for _ in range(copies)]
    return split, [cpu.pack_gguf_ksplit(int(kind), rows, k) for _ in range(copies)]


def multiply_each(weights: list[torch.Tensor], x: torch.Tensor, n: int) -> None:
    for weight in weights:
        cpu.linear(x, weight, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--shapes", default="28672x4096,4096x14336", help="N x K of each weight")
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--copies", type=int, default=4, help="weights multiplied in turn, so none stays cached")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if "amx" not in cpu.bf16_dots():
        raise SystemExit("needs AMX tiles, which this CPU or build lacks")
    print(f"CPU: {cpu_isa()}; {torch.get_num_threads()} threads; ms a product (the best of {args.rounds} rounds), "
          "GFLOP/s\n")
    print("| type | N x K | rows | split panels | K-quant panels | ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            split, ksplit = panels(TYPES[name], n, k, args.copies)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k)
                best = {"split": float("inf"), "ksplit": float("inf")}
                for _ in range(args.rounds):
                    for label, weights in (("split", split), ("ksplit", ksplit)):
                        seconds = seconds_per_call(partial(multiply_each, weights, x, n)) / args.copies
                        best[label] = min(best[label], seconds)
                rate = {label: 2 * m * n * k / s / 1e9 for label, s in best.items()}
                print(f"| {name} | {n} x {k} | {m} | {best['split'] * 1e3:.2f} ({rate['split']:.0f}) | "
                      f"{best['ksplit'] * 1e3:.2f} ({rate['ksplit']:.0f}) | {best['ksplit'] / best['split']:.2f}x |")


if __name__ == "__main__":
    main()
