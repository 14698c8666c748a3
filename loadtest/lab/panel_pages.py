"""Whether panels mapped from the panel cache's file (4 KiB pages of the page cache) multiply as fast as the same
panels in fresh memory on 2 MiB pages (what packing makes): the one-row products of every block weight of a GGUF
file, timed over each copy in turn.

    python -m loadtest.lab.panel_pages --model ~/.cache/harpoon/random-models/llama-3.1-8b-q4_k_m-seed0.gguf

A one-row product reads each weight from memory once, so it is where the pages would show (their TLB misses). The
cache file is written under a temporary folder and removed after.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.backends import panel_cache
from engine.backends.cpu import _pack_quantized
from engine.backends.gemm_plan import cpu_isa
from engine.backends.panel_cache import PanelCache
from engine.gguf_weights import iter_gguf_weights
from engine.models.quantized import FileBlocks
from kernels import cpu


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a .gguf file")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--exact", action="store_true", help="exact products (default: int8 activations, where the CPU "
                   "has integer dot products)")
    args = p.parse_args(argv)
    model = Path(args.model).expanduser()
    weights = [w for _, w in iter_gguf_weights(str(model), 1, 1) if isinstance(w, FileBlocks)]
    panel_cache.MIN_BYTES = 0
    with tempfile.TemporaryDirectory() as root:
        copies = []
        for _ in range(2):  # packed into fresh memory and written; then mapped from the file written
            cache = PanelCache(model, Path(root), cpu.panel_layout())
            copies.append([_pack_quantized(w, cache) for w in weights])
            cache.finish()
        fresh, mapped = copies
        assert cache.mapped_bytes and all(torch.equal(a, b) for a, b in zip(fresh, mapped, strict=True))
        int8 = not args.exact and cpu.q8x_available()
        xs = {w.in_features: torch.randn(1, w.in_features) for w in weights}

        def run(panels: list[torch.Tensor]) -> float:
            started = time.perf_counter()
            for w, packed in zip(weights, panels, strict=True):
                cpu.linear(xs[w.in_features], packed, w.shape[0], int8_activations=int8)
            return time.perf_counter() - started

        run(fresh), run(mapped)
        times = [(run(fresh), run(mapped)) for _ in range(args.rounds)]
    size = sum(t.nbytes for t in fresh)
    print(f"{model.name}: {len(weights)} weights, {size / 2**30:.2f} GiB of panels, one-row "
          f"{'int8' if int8 else 'exact'} products ({cpu_isa()}, {torch.get_num_threads()} threads), "
          f"{args.rounds} rounds alternating")
    for name, column in (("fresh 2 MiB pages", 0), ("mapped cache file", 1)):
        ms = statistics.median(t[column] for t in times) * 1000
        print(f"  {name}: median {ms:.1f} ms ({size / ms / 1e6:.1f} GB/s)")
    ratios = sorted(b / a for a, b in times)
    print(f"  mapped / fresh: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
