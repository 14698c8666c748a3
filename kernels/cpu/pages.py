"""Advice to the kernel about the pages under a host buffer: 2 MiB pages for the weights' panels, and a file
mapping's pages handed back once read; and the memory a first start packs its panels into (``PanelArena``), which
becomes the panel cache file's pages once that file is written.

Why 2 MiB pages for the weights: packing an 8B Q4_K_M model's 4.9 GB of panels from the page cache took 11.5-12.7 s,
and `perf` put 37% of the load's samples in the kernel zeroing fresh 4 KiB pages, one page fault each
(``clear_page_erms``). A fresh tensor advised onto 2 MiB pages before anything touches it faults 512x fewer times:
the same load took 9.0-10.9 s (docs/history/benchmarks-2026-12.md). Serving was not measurably faster or slower for it.
Where 2 MiB pages are off or the kernel refuses the advice, they are plain pages and nothing else changes.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

HUGE_PAGE = 2 << 20
MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000  # Linux's
MADV_POPULATE_READ = 22  # Linux 5.14: fault the pages in now, as reads (no private copies)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_ARENA: ContextVar[PanelArena | None] = ContextVar("panel_arena", default=None)


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


def empty_panels(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Memory for panels: the arena's where one is taking them (``PanelArena.taking``) and has room, else
    ``torch.empty(shape)`` advised onto huge pages before it is written (a fresh allocation this large is fresh
    pages from the kernel, so the advice takes at its first touch)."""
    arena = _ARENA.get()
    out = arena.take(shape, dtype) if arena is not None else None
    if out is not None:
        return out
    out = torch.empty(shape, dtype=dtype)
    advise_huge_pages(out.data_ptr(), out.nbytes)
    return out


def drop_pages(address: int, size: int) -> None:
    """madvise(MADV_DONTNEED) over the pages wholly inside [address, address + size) of a file's read-only mapping:
    they are read again from the page cache if touched. Advice only, so errors pass."""
    if hasattr(mmap, "MADV_DONTNEED"):
        _advise_inside(address, size, mmap.PAGESIZE, mmap.MADV_DONTNEED)


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


class PanelArena:
    """Fresh memory for the panels a start packs, handed out in order at whole pages, whose bytes a cache file then
    holds as they lie (``image``, offset for offset), so that once the file is written the arena becomes the
    file's pages (``remap``): the same bytes at the same addresses, with nothing that points at them changed.

    Why: packed into fresh 2 MiB pages, an 8B Q4_K_M file's 4.7 GiB of panels took 9.7-10.4 s on a Xeon where plain
    pages took 4.8-5.6 s, the page faults taken inside the packing threads; but one-row products read plain pages
    11% slower (docs/history/benchmarks-2026-12.md). Packed on plain pages and remapped onto the cache file, which the
    page cache keeps in 2 MiB folios, the panels are read through 2 MiB pages from then on, as at a later start.

    Invariant: every tensor ``take`` returns lies in [0, used) of the arena, at a page-aligned offset; the region
    is reserved, not committed (MAP_NORESERVE), so only the pages written cost memory."""

    def __init__(self, reserve: int) -> None:
        self.reserve = _aligned(reserve, HUGE_PAGE)
        self._region = mmap.mmap(-1, self.reserve + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                 | MAP_NORESERVE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._region))
        self.skip = (-address) % HUGE_PAGE  # the arena starts on a 2 MiB boundary, as the file's folios do
        self.address = address + self.skip
        self.used = 0
        self.remapped = False

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An empty tensor of ``shape`` from the arena's next pages; None where the reserve has no room for it."""
        count = dtype.itemsize
        for n in shape:
            count *= n
        if self.remapped or not count or self.used + count > self.reserve:
            return None
        out = torch.frombuffer(self._region, dtype=torch.uint8, count=count, offset=self.skip + self.used)
        self.used += _aligned(count, mmap.PAGESIZE)
        return out.view(dtype).view(shape)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t`` (contiguous) lies in the arena, or None where it lies elsewhere."""
        offset = t.data_ptr() - self.address
        inside = 0 <= offset and offset + t.nbytes <= self.used and t.is_contiguous()
        return offset if inside else None

    def image(self) -> memoryview:
        """The arena's bytes [0, used): what the cache file holds from its offset 0."""
        return memoryview(self._region)[self.skip:self.skip + self.used]

    @contextmanager
    def taking(self) -> Iterator[None]:
        """Within: ``empty_panels`` hands out this arena's memory (in this thread or task)."""
        token = _ARENA.set(self)
        try:
            yield
        finally:
            _ARENA.reset(token)

    def remap(self, fd: int) -> None:
        """Map [0, used) of the file ``fd`` (whose bytes are ``image()``'s) over the arena, private: one mmap that
        replaces the arena's pages with the file's, atomically, so threads reading the panels meanwhile read the
        same bytes before and after; then its pages faulted in, on 2 MiB pages where the page cache holds 2 MiB
        folios. Raises OSError where the kernel refuses: the arena is then as it was."""
        if not self.used:
            return
        got = _libc.mmap(self.address, self.used, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | MAP_FIXED,
                         fd, 0)
        if got != self.address:
            raise OSError(ctypes.get_errno(), "the panels could not be mapped from the cache file")
        self.remapped = True
        if hasattr(mmap, "MADV_HUGEPAGE"):
            _libc.madvise(ctypes.c_void_p(self.address), ctypes.c_size_t(self.used), mmap.MADV_HUGEPAGE)
        _libc.madvise(ctypes.c_void_p(self.address), ctypes.c_size_t(self.used), MADV_POPULATE_READ)
