"""The projections of one SmolLM2-135M decode step from compact panels (Q4, Q8 or BF16) against fp32 panels of
the same weights; or its LM head (``--head``).

Thirty layers of random weights on the format's grid (qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down
1536 -> 576), each layer its own, so every call streams its weights from memory as a real step does. The two
packings run interleaved, round by round; medians in ms. Each point includes the Python call per projection
(120 of them); the C decoder makes none. ``--head``: one 576 -> 49152 weight instead (113 MB in fp32, more than
the caches hold, so it streams too).

    python -m loadtest.lab.compact_gemm --rows 1,2,4,8,16,64            # Q4 panels
    python -m loadtest.lab.compact_gemm --format bf16
    python -m loadtest.lab.compact_gemm --format q8 --head              # the tied head of the default GGUF is Q8_0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import cpu

PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
HEAD = [(49152, 576)]


def q4_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random d q + m blocks of 32 inputs, with q = 0 and 15 in each block, as a Q4_1 quantizer leaves them."""
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(n, k)


def q8_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random d q blocks of 32 inputs, with |q| = 127 in each block, as a Q8_0 quantizer leaves them."""
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.001 + 1e-4).half().float()  # > 0: d 0 would give -0.0
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


def bf16_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=gen).to(torch.bfloat16).float()


GRIDS = {"q4": (q4_weight, torch.uint8), "q8": (q8_weight, torch.int8), "bf16": (bf16_weight, torch.bfloat16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--format", default="q4", choices=sorted(GRIDS))
    parser.add_argument("--head", action="store_true", help="the LM head (one layer) instead of the projections")
    args = parser.parse_args()
    shapes, layers = (HEAD, 1) if args.head else (PROJECTIONS, args.layers)
    gen = torch.Generator().manual_seed(0)
    make, dtype = GRIDS[args.format]
    compact = f"{args.format.upper()} panels"
    packings: dict[str, list[torch.Tensor]] = {"fp32 panels": [], compact: []}
    for _ in range(layers):
        for n, k in shapes:
            w = make(n, k, gen)
            packings["fp32 panels"].append(cpu.pack_weight(w))
            packings[compact].append(cpu.pack_weight_compact(w))
    assert all(p.dtype == dtype for p in packings[compact])
    print(f"| rows | fp32 panels (ms) | {compact} (ms) | ratio |\n|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {name: [] for name in packings}
        for _ in range(args.rounds):
            for name, packed in packings.items():
                start = time.perf_counter()
                for i, p in enumerate(packed):
                    n, k = shapes[i % len(shapes)]
                    cpu.linear(inputs[k], p, n)
                times[name].append((time.perf_counter() - start) * 1e3)
        full, small = (statistics.median(times[name]) for name in packings)
        print(f"| {rows} | {full:.2f} | {small:.2f} | {small / full:.2f} |", flush=True)


if __name__ == "__main__":
    main()
