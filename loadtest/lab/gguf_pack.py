"""How fast a GGUF file's blocks are packed into panels at load (``kernels/cpu/gguf_pack.c``), per block type: the
first tensor of each type in the file, packed once to fault its pages in, then timed over the same pages (the
file's in the page cache, the panels' already resident), so the figure is the packing alone.

    python -m loadtest.lab.gguf_pack --model ~/.cache/harpoon/random-models/llama-3.1-8b-q4_k_m-seed0.gguf
"""

from __future__ import annotations

import argparse
import time

import torch
from gguf import GGUFReader

from engine.backends.gemm_plan import cpu_isa
from kernels import cpu


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a .gguf file")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    reader, seen = GGUFReader(args.model), set()
    print(f"packing a GGUF file's blocks into panels ({cpu_isa()}, {torch.get_num_threads()} threads)")
    print("| type | tensor | MiB | best ms | GB/s of file |\n|---|---|---|---|---|")
    for t in reader.tensors:
        if t.tensor_type in seen or len(t.shape) != 2 or cpu.gguf_format(int(t.tensor_type), "exact") is None:
            continue
        seen.add(t.tensor_type)
        n, k = int(t.shape[1]), int(t.shape[0])
        rows = torch.arange(n, dtype=torch.int64) * (t.data.nbytes // n) + t.data.ctypes.data
        packers = {"": cpu.pack_gguf_rows}
        tiles_format = cpu.gguf_format(int(t.tensor_type), "tiles-fp32")
        if tiles_format is not None and "amx" in cpu.bf16_dots():
            tiles = tiles_format.name
            packers[f" as {tiles}"] = cpu.pack_gguf_ksplit  # the fp32 tiles' panels (AMX)
        for name, pack in packers.items():
            out = pack(int(t.tensor_type), rows, k)
            times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                pack(int(t.tensor_type), rows, k, out)
                times.append(time.perf_counter() - started)
            best = min(times)
            print(f"| {t.tensor_type.name}{name} | {t.name} | {t.data.nbytes / 2**20:.0f} | {best * 1000:.1f} | "
                  f"{t.data.nbytes / best / 1e9:.2f} |")


if __name__ == "__main__":
    main()
