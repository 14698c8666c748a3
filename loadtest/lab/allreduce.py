"""What a tensor-parallel step would pay for its all-reduces on this CPU: one step's activations ([tokens, hidden]
fp32) summed across ranks on this host, per call and per step (two a layer), two ways:
- ``gloo``: torch.distributed's all-reduce (through the kernel's loopback);
- ``shm``: each rank writes its rows into one shared-memory buffer, the ranks meet at a spin barrier, and each sums
  the buffer's rows in the same order (so every rank holds the same bits), then meets again before the buffer is
  reused. A sketch of the shared-memory all-reduce SGLang's Xeon backend uses, in plain torch.

    python -m loadtest.lab.allreduce --ranks 2 --hidden 576 --layers 30 --tokens 1,16,64,256

Set against the step times of the step profile (``loadtest.serve`` prints them) it says whether the all-reduce
would dominate a CPU step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from multiprocessing import shared_memory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class ShmAllReduce:
    """In-place sum of a tensor across the ranks of one host through a shared buffer (see the module docstring)."""

    def __init__(self, name: str, rank: int, ranks: int, max_elems: int) -> None:
        self.shm = shared_memory.SharedMemory(name=name)
        self.rank = rank
        self.data = torch.frombuffer(self.shm.buf, dtype=torch.float32, count=ranks * max_elems).view(ranks, -1)
        self.flags = torch.frombuffer(self.shm.buf, dtype=torch.int64, count=ranks, offset=ranks * max_elems * 4)
        self.generation = 0

    def _meet(self) -> None:
        self.generation += 1
        self.flags[self.rank] = self.generation
        while bool((self.flags < self.generation).any()):
            os.sched_yield()  # a rank without a core of its own must not spin out the one it waits for

    def __call__(self, x: torch.Tensor) -> None:
        n = x.numel()
        self.data[self.rank, :n].copy_(x.view(-1))
        self._meet()
        torch.sum(self.data[:, :n], dim=0, out=x.view(-1))
        self._meet()  # nobody writes the buffer again before everyone has read it

    @staticmethod
    def size(ranks: int, max_elems: int) -> int:
        return ranks * max_elems * 4 + ranks * 8


def _rank(rank: int, ranks: int, port: int, shm_name: str, hidden: int, tokens: list[int], reps: int,
          out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    shm = ShmAllReduce(shm_name, rank, ranks, max(tokens) * hidden)
    try:
        for impl, reduce in (("gloo", dist.all_reduce), ("shm", shm)):
            for n in tokens:
                x = torch.full((n, hidden), float(rank + 1))
                for _ in range(5):
                    reduce(x)
                times = []
                for _ in range(reps):
                    x.fill_(rank + 1)
                    dist.barrier()
                    start = time.perf_counter()
                    reduce(x)
                    times.append(time.perf_counter() - start)
                    if not bool((x == ranks * (ranks + 1) / 2).all()):
                        raise AssertionError(f"{impl} summed wrong")
                if rank == 0:
                    out[(impl, n)] = statistics.median(times)
    finally:
        del shm.data, shm.flags
        shm.shm.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tokens", default="1,16,64,256")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    buffer = shared_memory.SharedMemory(create=True, size=ShmAllReduce.size(args.ranks, max(tokens) * args.hidden))
    buffer.buf[:] = bytes(buffer.size)
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, args=(args.ranks, args.port, buffer.name, args.hidden, tokens, args.reps, out),
                     nprocs=args.ranks)
            results = dict(out)
    finally:
        buffer.close()
        buffer.unlink()
    print(f"all-reduce, {args.ranks} ranks on this host, fp32 [tokens, {args.hidden}]; a step of {args.layers} "
          f"layers makes {2 * args.layers} of them")
    print("| tokens | gloo, one (us) | gloo, per step (ms) | shm, one (us) | shm, per step (ms) |")
    print("|---|---|---|---|---|")
    for n in tokens:
        g, s = results[("gloo", n)], results[("shm", n)]
        print(f"| {n} | {g * 1e6:.0f} | {2 * args.layers * g * 1e3:.2f} | {s * 1e6:.0f} | "
              f"{2 * args.layers * s * 1e3:.2f} |")


if __name__ == "__main__":
    main()
