"""What finding a weight's 4- and 8-bit blocks costs at load (``kernels/cpu/blocks.py``), per GGUF format.

A weight of each format, dequantized by gguf's own code as transformers loads it, then searched as
``pack_weight_blocks`` searches it: Q4 blocks first, then Q8 where those are refused. Q4_K comes from random raw
super-blocks (gguf has no Q4_K quantizer), so many of its blocks reach neither q = 0 nor 15, the search's slowest
case; F32 is a checkpoint off every grid. Medians of the rounds, in ns per weight, beside what gguf's
dequantization of the same weight took.

    python -m loadtest.lab.find_blocks
    python -m loadtest.lab.find_blocks --rows 4096 --cols 4096 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from kernels.cpu import blocks

FORMATS = ("Q4_1", "Q4_0", "Q4_K", "Q5_0", "Q8_0")


def raw_weight(kind: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """The GGUF bytes of a random weight [rows, cols] in ``kind``."""
    if kind != GGMLQuantizationType.Q4_K:
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.02, kind)  # F32: as is
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)  # 144 bytes per 256 weights
    for offset in (0, 2):  # the super-block's d and dmin, fp16
        scale = rng.uniform(1e-4, 3e-3, (rows, cols // 256)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def find(weight: torch.Tensor) -> str:
    if blocks.q4_blocks(weight) is not None:
        return "Q4"
    return "Q8" if blocks.q8_blocks(weight) is not None else "refused"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.lab.find_blocks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096, help="a multiple of 256 (a Q4_K super-block)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.cols % 256:
        parser.error(f"--cols must be a multiple of 256, got {args.cols}")
    rng = np.random.default_rng(0)
    print("| format | panels | find (ns/weight) | gguf dequantize (ns/weight) |\n|---|---|---|---|")
    for name in (*FORMATS, "F32"):
        kind = getattr(GGMLQuantizationType, name)
        raw = raw_weight(kind, args.rows, args.cols, rng)
        dequantize, search = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            weight = torch.from_numpy(quants.dequantize(raw, kind).astype(np.float32))
            dequantize.append(time.perf_counter() - start)
            start = time.perf_counter()
            panels = find(weight)
            search.append(time.perf_counter() - start)
        per = 1e9 / weight.numel()
        print(f"| {name} | {panels} | {statistics.median(search) * per:.1f} | "
              f"{statistics.median(dequantize) * per:.1f} |")


if __name__ == "__main__":
    main()
