"""A greedy step's LM head on AMX: the logits written and numpy's argmax over them, against ``argmax_linear``'s
argmax as the tiles produce them (the same tokens), at SmolLM2-135M's tied head (49152 x 576 in BF16A panels).

    python -m loadtest.lab.greedy_head --rows 1,16,58,110

As in a step, a layer's worth of memory streams through the caches between two calls, so the head's panels come
from DRAM; the two ways alternate round by round (the machines this runs on drift) and are compared by medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.sampler import argmax_rows
from kernels import cpu as cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,58,110")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    if "amx" not in cpu_kernels.bf16_dots():
        raise SystemExit("this CPU (or build) has no AMX tiles: the argmax is taken from the written logits")
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    head = cpu_kernels.pack_weight_bf16a(torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5)
    stream = torch.ones(32 << 20)
    ways = {"written": lambda x: argmax_rows(cpu_kernels.linear(x, head, args.vocab)),
            "as they come": lambda x: cpu_kernels.argmax_linear(x, head, args.vocab)}
    print("| rows | logits written + numpy argmax (ms) | argmax as the tiles come out (ms) |\n|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, args.hidden, generator=gen)
        assert torch.equal(ways["written"](x), ways["as they come"](x))
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in list(ways)[:: 1 if r % 2 else -1]:
                stream.sum()
                start = time.perf_counter()
                ways[name](x)
                seconds[name].append(time.perf_counter() - start)
        print(f"| {rows} | " + " | ".join(f"{statistics.median(s) * 1e3:.2f}" for s in seconds.values()) + " |")


if __name__ == "__main__":
    main()
