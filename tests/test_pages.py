"""Advice on a host buffer's pages (kernels/cpu/pages.py): the weights' panels on 2 MiB pages, a file mapping's pages
handed back once read, and the arena a first start packs into, remapped onto the file of its bytes."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.cpu.pages import HUGE_PAGE, PanelArena, drop_pages, empty_panels

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()  # e.g. "always [madvise] never"
THP_OFF = "[never]" in _THP_MODE


def smaps_line(address: int, field: str) -> str:
    """What follows ``field:`` (AnonHugePages, Rss, VmFlags) for the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == f"{field}:":
            return line[len(head):].strip()
    raise AssertionError(f"no mapping holds {address:#x}")


def smaps_field(address: int, field: str) -> int:
    """Bytes of ``field`` (AnonHugePages, Rss) of the mapping of this process that holds ``address``."""
    return int(smaps_line(address, field).split()[0]) * 1024


def fresh_panel_and_plain_tensor() -> None:
    """The advised tensor lies on 2 MiB pages once written and carries the advice; a plain one beside it does not
    carry it. Run in a fresh process: a long one's heap may hand back memory advised earlier."""
    out = empty_panels(3, 4 << 20, dtype=torch.float32)  # 48 MiB
    assert out.shape == (3, 4 << 20) and out.dtype == torch.float32
    out.fill_(1.0)
    start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the advice splits the mapping: its middle holds these
    inside = (out.data_ptr() + out.nbytes) // HUGE_PAGE * HUGE_PAGE - start
    assert smaps_field(start, "AnonHugePages") >= 0.9 * inside
    assert "hg" in smaps_line(start, "VmFlags").split()  # the advice is on the mapping: VM_HUGEPAGE
    # Whether plain memory gets 2 MiB pages too is the machine's choice (its per-size THP modes), so the plain
    # tensor is told apart by its flags, not by its pages.
    plain = torch.empty(3, 4 << 20, dtype=torch.float32)
    plain.fill_(1.0)
    assert "hg" not in smaps_line(-(-plain.data_ptr() // HUGE_PAGE) * HUGE_PAGE, "VmFlags").split()


@pytest.mark.skipif(THP_OFF, reason="transparent huge pages are off on this machine")
def test_a_fresh_panel_tensor_lies_on_huge_pages_once_written():
    code = "from tests.test_pages import fresh_panel_and_plain_tensor as f; f()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_small_tensor_is_a_plain_empty_tensor():
    out = empty_panels(5, 7, dtype=torch.int16)
    assert out.shape == (5, 7) and out.dtype == torch.int16 and out.is_contiguous()


def test_dropped_pages_of_a_file_mapping_leave_this_process_and_read_back_the_same(tmp_path):
    path = tmp_path / "blocks.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 * mmap.PAGESIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(mapped.sum()) == int(data.sum())  # every page touched
    resident = smaps_field(mapped.ctypes.data, "Rss")
    drop_pages(mapped.ctypes.data + 100, 32 * mmap.PAGESIZE)  # pages wholly inside: 31 of them
    assert smaps_field(mapped.ctypes.data, "Rss") == resident - 31 * mmap.PAGESIZE
    assert np.array_equal(mapped, data)


def mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_arena_hands_out_its_pages_in_order_within_taking_and_nothing_past_its_reserve():
    arena = PanelArena(4 << 20)
    outside = empty_panels(8, dtype=torch.int16)
    with arena.taking():
        a = empty_panels(1000, dtype=torch.float32)  # 4000 bytes: a page
        b = empty_panels(3, 700, dtype=torch.uint8)
        too_big = empty_panels(1 << 20, dtype=torch.float32)  # 4 MiB past the 4 KiB used
    assert arena.address % HUGE_PAGE == 0
    assert (arena.offset_of(a), arena.offset_of(b), arena.used) == (0, mmap.PAGESIZE, 2 * mmap.PAGESIZE)
    assert b.shape == (3, 700) and b.dtype == torch.uint8 and b.is_contiguous()
    assert arena.offset_of(too_big) is None and arena.offset_of(outside) is None
    assert arena.offset_of(b[:, 1:]) is None  # not contiguous: not a whole entry of the image


def test_a_remapped_arena_holds_the_files_bytes_at_the_same_addresses_while_it_is_read(tmp_path):
    arena = PanelArena(64 << 20)
    with arena.taking():
        panels = [empty_panels(n, dtype=torch.float32) for n in (3 << 20, 5000, 2 << 20)]
    for i, p in enumerate(panels):
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    expected = [p.clone() for p in panels]
    path = tmp_path / "panels.bin"
    path.write_bytes(arena.image())
    assert mapped_file(panels[0].data_ptr()) == ""
    sums, stop = [], threading.Event()

    def read() -> None:  # a reader all through the remap, as an engine's step is
        while not stop.is_set():
            sums.append(sum(float(p.sum()) for p in panels))

    reader = threading.Thread(target=read)
    reader.start()
    fd = os.open(path, os.O_RDONLY)
    try:
        arena.remap(fd)
    finally:
        os.close(fd)
    stop.set()
    reader.join()
    assert all(mapped_file(p.data_ptr()) == str(path) for p in panels)
    assert all(torch.equal(p, e) for p, e in zip(panels, expected, strict=True))
    assert len(set(sums)) == 1  # every read, before, during and after, the same bytes
    with arena.taking():  # remapped: no more pages handed out
        assert arena.offset_of(empty_panels(16, dtype=torch.float32)) is None
