"""What ``--quantized-matmul int8`` buys a GGUF file's products on this CPU: per block type and row count, the time
of one product over the packed panels with exact fp32 activations against activations rounded to int8, through each
integer dot product this CPU has (VNNI's u8 x s8, AVX2's maddubs), the same weight, alternating. Random blocks of
realistic scales (``loadtest.models``), written to a GGUF file and read back through gguf-py, as a served file is.

    python -m loadtest.lab.int8_gemm --rows 1,4,16,64,256 --shape 8192x2048

An 8192 x 2048 weight's panels (9-18 MB) sit in the L3 of the development machines between repetitions; pass a
larger ``--shape`` to time them from memory.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

from engine.backends.cpu import _pack_quantized
from engine.backends.gemm_plan import cpu_isa
from engine.gguf_weights import decode
from engine.models.quantized import QuantizedWeight
from kernels import cpu
from loadtest.models import random_blocks

# "Q6M": rows of two types stacked in one kind wide enough for both, as a fused projection of more than two runs of
# types is held (two runs, as Q4_K_M's q/k/v, are two panels: engine/models/quantized.py, SplitBlocks)
TYPES = {"Q4_K": [Q.Q4_K], "Q6_K": [Q.Q6_K], "Q8_0": [Q.Q8_0], "Q6M": [Q.Q4_K, Q.Q6_K]}


def weights(n: int, k: int, folder: Path) -> dict[str, QuantizedWeight]:
    """One weight [n, k] per entry of TYPES; a mix stacks half its rows of each type (Q6M panels)."""
    rng, path = np.random.default_rng(0), folder / "weights.gguf"
    writer = GGUFWriter(str(path), "llama")
    for name, kinds in TYPES.items():
        for i, kind in enumerate(kinds):
            writer.add_tensor(f"{name}.{i}", random_blocks(rng, n // len(kinds), k, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    return {name: QuantizedWeight.cat([decode(tensors[f"{name}.{i}"]) for i in range(len(kinds))])
            for name, kinds in TYPES.items()}


def seconds(x: torch.Tensor, packed: torch.Tensor, n: int, dot: str | None, reps: int) -> float:
    """Mean seconds of one product: exact (``dot`` None) or with int8 activations through ``dot``."""
    body = cpu.Body(int8_dot=dot)
    cpu.linear(x, packed, n, int8_activations=dot is not None, body=body)
    start = time.perf_counter()
    for _ in range(reps):
        cpu.linear(x, packed, n, int8_activations=dot is not None, body=body)
    return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--shape", default="8192x2048", help="N x K of the weight")
    p.add_argument("--rounds", type=int, default=5, help="alternations of the ways; the median is printed")
    args = p.parse_args(argv)
    dots = cpu.q8x_dots()
    if not dots:
        raise SystemExit("this CPU has no integer dot products (VNNI or AVX2): the int8 path is off")
    n, k = (int(v) for v in args.shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        made = weights(n, k, Path(tmp))
    ways = [None, *dots]
    names = ["exact", *(f"int8 {d}" for d in dots)]
    print(f"one product [rows, {k}] x [{k}, {n}], {torch.get_num_threads()} threads, ISA {cpu_isa()}; ms (median "
          f"of {args.rounds}), GFLOP/s, speed-up over exact")
    print("| type | rows | " + " | ".join(f"{w} (ms)" for w in names) + " | "
          + " | ".join(f"{w} GFLOP/s" for w in names) + " | " + " | ".join(f"{w} speed-up" for w in names[1:]) + " |")
    print("|---|---|" + "---|" * (3 * len(names) - 1))
    for name, weight in made.items():
        packed = _pack_quantized(weight)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            reps = max(2, int(2e9 / (2 * rows * n * k)))  # ~1 s of products a way at ~100 GFLOP/s
            times: dict[str | None, list[float]] = {w: [] for w in ways}
            for _ in range(args.rounds):
                for way in ways:
                    times[way].append(seconds(x, packed, n, way, reps))
            ms = [float(np.median(times[w])) for w in ways]
            flops = 2 * rows * n * k
            print(f"| {name} | {rows} | " + " | ".join(f"{t * 1e3:.2f}" for t in ms) + " | "
                  + " | ".join(f"{flops / t / 1e9:.0f}" for t in ms) + " | "
                  + " | ".join(f"{ms[0] / t:.2f}x" for t in ms[1:]) + " |")


if __name__ == "__main__":
    main()
