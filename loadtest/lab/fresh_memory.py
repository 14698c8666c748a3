"""What fresh memory costs this machine: seconds to write a new anonymous mapping of ``--gib`` for the first time, on
4 KiB pages and advised onto 2 MiB pages, each written a second time after (its pages then resident), with a pause
before each new mapping, in which a guest VM may hand the pages it freed back to its host.

    python -m loadtest.lab.fresh_memory --gib 4.6 --threads 1,2

Why: a model's first start packs its panels into fresh memory (``kernels/cpu/pages.py``'s ``PanelArena``), so the
rate here bounds its load step from below, whatever the packer's speed (``gguf_pack.py``): an 8B Q4_K_M's 4.6 GiB
of panels at this rate, against one read of its file (``load_cost.py``), is how close that start can come to the
target of twice one read.
"""

from __future__ import annotations

import argparse
import mmap
import time

import torch

from engine.backends.gemm_plan import cpu_isa
from kernels.cpu.pages import advise_huge_pages


def write_seconds(region: mmap.mmap) -> float:
    """Seconds of one ``fill_`` over the whole of ``region``."""
    view = torch.frombuffer(region, dtype=torch.uint8)
    started = time.perf_counter()
    view.fill_(1)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.6, help="the mapping's size (an 8B Q4_K_M's panels: 4.6)")
    p.add_argument("--threads", default="1,2", help="torch threads that write, one or more")
    p.add_argument("--rounds", type=int, default=2, help="mappings of each kind for each thread count")
    p.add_argument("--pause", type=float, default=5.0, help="seconds before each new mapping")
    args = p.parse_args(argv)
    size = int(args.gib * 2**30)
    print(f"fresh memory, {args.gib} GiB a mapping ({cpu_isa()})")
    print("| threads | pages | first write s | GB/s | second write s |")
    print("|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for _ in range(args.rounds):
            for huge in (False, True):
                time.sleep(args.pause)
                region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                try:
                    if huge:
                        view = torch.frombuffer(region, dtype=torch.uint8)
                        advise_huge_pages(view.data_ptr(), size)
                        del view
                    first = write_seconds(region)
                    again = write_seconds(region)
                finally:
                    region.close()
                print(f"| {threads} | {'2 MiB' if huge else '4 KiB'} | {first:.2f} | {size / first / 1e9:.2f} | "
                      f"{again:.2f} |")


if __name__ == "__main__":
    main()
