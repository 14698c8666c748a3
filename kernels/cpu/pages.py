"""Advice to the kernel about the pages under a host buffer: 2 MiB pages for the weights' panels, and a file
mapping's pages handed back once read.

Why 2 MiB pages for the weights: packing an 8B Q4_K_M model's 4.9 GB of panels from the page cache took 11.5-12.7 s,
and `perf` put 37% of the load's samples in the kernel zeroing fresh 4 KiB pages, one page fault each
(``clear_page_erms``). A fresh tensor advised onto 2 MiB pages before anything touches it faults 512x fewer times:
the same load took 9.0-10.9 s (docs/benchmarks.md). Serving was not measurably faster or slower for it. Where 2 MiB
pages are off or the kernel refuses the advice, they are plain pages and nothing else changes.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _advise_inside(address: int, size: int, page: int, advice: int) -> None:
    """madvise(``advice``) over the ``page``-sized pages wholly inside [address, address + size)."""
    start, end = -(-address // page) * page, (address + size) // page * page
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


def advise_huge_pages(address: int, size: int) -> None:
    """madvise(MADV_HUGEPAGE) over the 2 MiB pages wholly inside [address, address + size) of anonymous memory: the
    pages not yet touched there fault in as huge pages. Advice only, so errors pass."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        _advise_inside(address, size, HUGE_PAGE, mmap.MADV_HUGEPAGE)


def empty_on_huge_pages(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape)`` advised onto huge pages before it is written (a fresh allocation this large is fresh
    pages from the kernel, so the advice takes at its first touch)."""
    out = torch.empty(shape, dtype=dtype)
    advise_huge_pages(out.data_ptr(), out.nbytes)
    return out


def drop_pages(address: int, size: int) -> None:
    """madvise(MADV_DONTNEED) over the pages wholly inside [address, address + size) of a file's read-only mapping:
    they are read again from the page cache if touched. Advice only, so errors pass."""
    if hasattr(mmap, "MADV_DONTNEED"):
        _advise_inside(address, size, mmap.PAGESIZE, mmap.MADV_DONTNEED)
