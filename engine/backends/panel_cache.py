"""A model's packed panels kept in a file of their own, and mapped at the next start instead of packed again.

Why: packing an 8B Q4_K_M file's 4.6 GB of panels took 4-10 s of each start (most of it the kernel handing out
fresh zeroed pages), where one read of the file took 1.2-4 s, so a load could not come near twice one read. Mapped
from the page cache in 2 MiB pages (``_HugePageWriter``), the panels multiply as fast as in fresh memory (one-row
int8 products over an 8B model's 4.6 GB: 1.008x the time, ``loadtest/lab/panel_pages.py``), and a start costs at
most one read of them. A checkpoint of dense weights (a folder of safetensors) is the same: a 1B bfloat16 model's
2.4 GB of BF16C panels took ~3.7 s of its start, nearly all of it fresh 2 MiB pages.

One cache file holds the panels of one source, a GGUF file or a checkpoint folder (its path, and the size and mtime
of the file or of each of the folder's safetensors), in one panel layout (``kernels.cpu.panel_layout``: the kernels'
build, the Python that shapes panels, and the switches that turn kinds of panel off). Each entry is named by what it
was packed from: a GGUF file's by the ggml type, the inputs and the file position of every output row's blocks, so
a changed fusion or row order misses and is packed anew; a dense weight's by its module's name, its shape and dtype,
and the packing function. It never maps the wrong panels. The file is written whole, beside its place and renamed
into it, its index last; older files of the same source, and those of sources gone or changed, are removed then.
The engine writes it from a thread of its own while it serves (``finish(wait=False)``); a server stopped before
the write ends leaves a half-written file, which the next start removes. A first start packs into an arena
(``kernels.cpu.pages.PanelArena``) whose bytes open the file as they lie, and once the file is written the arena is
remapped onto it: from then on the first start reads its panels from the file's pages, as a later start does.
Small models are not cached (``MIN_BYTES``): they pack in well under a second.

The pages are the page cache's, so they count as available memory (/proc/meminfo): the KV pool's budget leaves them
out (``mapped_bytes``, ``TorchBackend.kv_cache_bytes``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

from engine.models.quantized import FileBlocks
from kernels.cpu.pages import HUGE_PAGE, MADV_POPULATE_READ, PanelArena

logger = logging.getLogger(__name__)

CACHE_VERSION = 1  # of this file's format
MIN_BYTES = 256 << 20  # panels below this are packed at each start (a 135M model's take ~0.1 s)
ALIGN = 4096  # each entry on a page of its own
SPARE_DISK = 1 << 30  # what writing leaves free on the disk at least
ARENA_RESERVE = 3  # the arena's address space in sources' sizes, reserved, not committed (a bf16 file's fp32: 2)
_TMP_PREFIX = ".tmp-{pid}-"  # a file being written, by process pid
_WRITERS: dict[Path, threading.Thread] = {}  # the background writes of this process, by the file each writes


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _advise(mapping: mmap.mmap, advice: int | None, start: int = 0, length: int = 0) -> None:
    """madvise over ``length`` bytes from ``start`` (0: to the end), widened to whole pages. Advice only (Linux's;
    MADV_POPULATE_READ is 5.14's): where refused, the pages fault in as they are read."""
    begin = start - start % mmap.PAGESIZE
    try:
        mapping.madvise(advice, begin, length + start - begin if length else len(mapping) - begin)
    except (OSError, TypeError, ValueError):
        pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True


def _weight_files(source: Path) -> list[Path]:
    return sorted(source.glob("*.safetensors")) if source.is_dir() else [source]


def source_stamp(source: Path) -> str:
    """What changes when ``source`` (a GGUF file, or a folder of safetensors) is written again: the size and mtime
    of the file, or of each of the folder's weight files."""
    return ";".join(f"{f.name}:{st.st_size}:{st.st_mtime_ns}" for f in _weight_files(source) for st in [f.stat()])


class PanelCache:
    """The panels of ``source``'s weights as this build packs them: mapped where a whole cache file exists, else
    packed and, once all are (``finish``), written for the next start."""

    def __init__(self, source: Path, root: Path, layout: str) -> None:
        self.source = source.resolve()
        self.stamp = source_stamp(self.source)
        self.folder = root / "panels"
        name = self.source.name if self.source.is_dir() else self.source.stem
        self.prefix = f"{name}-{_digest(str(self.source))[:8]}"
        key = _digest(f"{CACHE_VERSION}:{self.source}:{self.stamp}:{layout}")[:16]
        self.data_path = self.folder / f"{self.prefix}-{key}.bin"
        self.index_path = self.folder / f"{self.prefix}-{key}.json"
        self._mapping: mmap.mmap | None = None
        self._entries: dict[str, dict] = {}
        self._used: dict[str, torch.Tensor] = {}  # every weight packed or mapped, by its name, in packing order
        self._packed = 0  # of those, weights packed here
        self._arena: PanelArena | None = None  # what they are packed into, where the file will be written
        self.wait()  # another start's writer of this very file, in this process: its file, once whole
        self._open()
        source_bytes = sum(f.stat().st_size for f in _weight_files(self.source))
        if self._mapping is None and source_bytes >= MIN_BYTES:
            try:
                self._arena = PanelArena(ARENA_RESERVE * source_bytes + (1 << 30))
            except OSError as e:  # address space refused (strict overcommit): packed into fresh tensors instead
                logger.info("panels packed outside an arena: %s", e)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of panels mapped at this start from the cache file an earlier start wrote."""
        return len(self._mapping) if self._mapping is not None else 0

    def _open(self) -> None:
        try:
            index = json.loads(self.index_path.read_text())
            entries = dict(index["entries"])
            with open(self.data_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if index["version"] != CACHE_VERSION or index["bytes"] != size or not size:
                    return  # not whole: packed anew and written again
                # private and writable, so torch takes it as a buffer; nothing writes it, so no page is copied
                mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, KeyError, TypeError):
            return
        _advise(mapping, getattr(mmap, "MADV_HUGEPAGE", None))  # read from the disk, its pages come in as 2 MiB folios
        self._mapping, self._entries = mapping, entries
        logger.info("panels of %s mapped from %s: %.0f MiB", self.source.name, self.data_path, size / 2**20)

    def pack(self, weight: FileBlocks, pack: Callable[[], torch.Tensor], kind: str = "") -> torch.Tensor:
        """``weight``'s panels: the cache file's, where it holds them, else ``pack()``'s. ``kind`` names panels other
        than its kind's own (the Q4S panels of Q4 blocks), which are entries of their own."""
        positions = weight.file_positions()
        if positions is None:  # not known to come from the file: packed, not cached
            return pack()
        name = f"{kind}:" if kind else ""
        return self._entry(_digest(f"{name}{weight.type_id}:{weight.in_features}:".encode()
                                   + positions.numpy().tobytes()), pack)

    def pack_dense(self, name: str, weight: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor | None],
                   read: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """The panels ``pack(weight)`` makes of module ``name``'s dense weight: the cache file's, where it holds
        them, else ``pack``'s (None, where it makes none, is neither cached nor returned from the cache). ``read``:
        the weight's values, called only where packed here, where ``weight`` gives only its shape and dtype."""
        how = getattr(pack, "__qualname__", None) or repr(pack)
        key = _digest(f"dense:{name}:{list(weight.shape)}:{weight.dtype}:{getattr(pack, '__module__', '')}.{how}")
        return self._entry(key, (lambda: pack(read())) if read is not None else partial(pack, weight))

    def _entry(self, key: str, pack: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        panels = self._mapped(self._entries.get(key))
        if panels is None:
            with self._arena.taking() if self._arena is not None else nullcontext():
                panels = pack()
            if panels is None:
                return None
            self._packed += 1
        self._used[key] = panels
        return panels

    def _mapped(self, entry: dict | None) -> torch.Tensor | None:
        """An entry's panels in the mapping; None where there is none, or the entry does not fit it."""
        if entry is None or self._mapping is None:
            return None
        try:
            dtype, shape = getattr(torch, entry["dtype"]), torch.Size(entry["shape"])
            count = shape.numel() * dtype.itemsize
            panels = torch.frombuffer(self._mapping, dtype=torch.uint8, count=count, offset=entry["offset"])
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError):
            return None
        # its pages read in now rather than in the first steps; one entry at a time, as the weight it replaces is let
        # go (a checkpoint's dense weights are all loaded before they are packed: the whole file populated at once
        # held them and the mapping together, 0.8 GiB over the packed start's peak for a 1B bfloat16 model)
        _advise(self._mapping, MADV_POPULATE_READ, entry["offset"], count)
        return panels.view(dtype).view(shape)

    def finish(self, wait: bool = True) -> None:
        """Once every weight is packed: write the cache file where this start packed any, or used other entries
        than the file's; enough disk and panels enough to be worth it. Not ``wait``: a thread of its own writes it
        while the engine serves (``wait`` joins it).

        Why: the write took 11-14 s of an 8B model's first start (4.9 GB through this machine's page cache and disk,
        0.2-1 GB/s), more than packing the panels did; the server is up without it, and the next start needs it."""
        if not self._packed and self._used.keys() == self._entries.keys():
            return
        arena = self._arena
        outside = [t for t in self._used.values() if arena is None or arena.offset_of(t) is None]
        total = (arena.used if arena is not None else 0) + sum(_aligned(t.nbytes) for t in outside)
        if total < MIN_BYTES:
            return
        if wait:
            self._store(total)
            return
        writer = threading.Thread(target=self._store, args=(total,), name="panel-cache-writer", daemon=True)
        _WRITERS[self.data_path] = writer
        writer.start()

    def wait(self) -> None:
        """Until the cache file ``finish`` writes in the background is written (or not, as it logs)."""
        writer = _WRITERS.get(self.data_path)
        if writer is not None:
            writer.join()

    def _store(self, total: int) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # both before the disk's free space is counted: the older files of this source (another panel layout)
            # would go once this one is written, and a disk with room for one model's panels holds this one then
            self._remove_abandoned()
            self._prune()
            free = shutil.disk_usage(self.folder).free
            if free < total + SPARE_DISK:
                logger.info("panels not cached: %.0f MiB free in %s, %.0f MiB needed", free / 2**20, self.folder,
                            (total + SPARE_DISK) / 2**20)
                return
            started = time.monotonic()
            written = self._write()
        except OSError as e:  # a cache only: the server runs as well without it
            logger.warning("panels not cached in %s: %s", self.folder, e)
            return
        logger.info("panels of %s cached in %s: %.0f MiB in %.1f s (mapped from there at the next start)",
                    self.source.name, self.data_path, total / 2**20, time.monotonic() - started)
        try:
            self._remap(written)
        finally:
            os.close(written)

    def _remap(self, written: int) -> None:
        """The arena's panels onto the file just written (``written``: its descriptor, whatever its name holds now),
        whose first bytes are the arena's."""
        if self._arena is None or not self._arena.used:
            return
        try:
            self._arena.remap(written)
        except OSError as e:  # they stay where they were packed
            logger.warning("panels not remapped onto %s: %s", self.data_path, e)
            return
        logger.info("panels of %s read from %s's pages from now on: %.0f MiB", self.source.name, self.data_path,
                    self._arena.used / 2**20)

    def _write(self) -> int:
        """The arena's bytes as they lie (their entries at their offsets in it), then the other panels; a descriptor
        of the file written, for the caller to close."""
        arena = self._arena
        entries, offset = {}, arena.used if arena is not None else 0
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=_TMP_PREFIX.format(pid=os.getpid()), suffix=".bin")
        written = os.dup(fd)  # the file itself, whatever its name comes to hold
        try:
            with _HugePageWriter(fd) as f:
                if offset:
                    f.write(arena.image())
                for name, panels in self._used.items():
                    at = arena.offset_of(panels) if arena is not None else None
                    if at is None:
                        f.write(memoryview(panels.contiguous().view(-1).view(torch.uint8).numpy()))
                        f.write(bytes(_aligned(panels.nbytes) - panels.nbytes))
                        at, offset = offset, offset + _aligned(panels.nbytes)
                    entries[name] = {"dtype": str(panels.dtype).removeprefix("torch."), "shape": list(panels.shape),
                                     "offset": at}
            os.replace(tmp, self.data_path)
            index = {"version": CACHE_VERSION, "source": str(self.source), "stamp": self.stamp, "bytes": offset,
                     "entries": entries}
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=_TMP_PREFIX.format(pid=os.getpid()), suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(index, f)
            os.replace(tmp, self.index_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            os.close(written)
            raise
        return written

    def _remove_abandoned(self) -> None:
        """Remove the half-written files of writers no longer running (a server stopped while its first start
        wrote): each as large as a model."""
        for tmp in self.folder.glob(".tmp-*"):
            writer = tmp.name.split("-")[1]
            if not writer.isdigit() or not _running(int(writer)):
                tmp.unlink(missing_ok=True)

    def _prune(self) -> None:
        """Remove the other cache files of this source, and those whose source is gone or changed since."""
        for index_path in self.folder.glob("*.json"):
            if index_path == self.index_path or index_path.name.startswith("."):  # (another's, being written)
                continue
            data_path = index_path.with_suffix(".bin")
            try:
                index = json.loads(index_path.read_text())
                source = Path(index["source"])
                stale = index_path.name.startswith(self.prefix + "-") or not source.exists() \
                    or index["stamp"] != source_stamp(source)
            except (OSError, ValueError, KeyError):
                stale = True
            if stale:
                index_path.unlink(missing_ok=True)
                data_path.unlink(missing_ok=True)


class _HugePageWriter:
    """Writes a file in whole 2 MiB pieces at 2 MiB offsets, then makes it durable (``fsync``) as it closes.

    Why: the page cache keeps a file written this way in 2 MiB folios, which a mapping then takes as 2 MiB pages.
    Written entry by entry, about half of an 8B model's cache file was left in smaller folios, and the one-row
    products over its panels took 3-4% longer than over fresh 2 MiB pages; all in 2 MiB folios, the same time
    (``python -m loadtest.lab.panel_pages``, docs/history/benchmarks-2026-12.md)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.piece, self.filled = fd, bytearray(HUGE_PAGE), 0

    def write(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        while data:
            if not self.filled and len(data) >= HUGE_PAGE:  # a whole piece written from where it lies: no copy
                _write_all(self.fd, data[:HUGE_PAGE])
                data = data[HUGE_PAGE:]
                continue
            n = min(len(data), HUGE_PAGE - self.filled)
            self.piece[self.filled:self.filled + n] = data[:n]
            self.filled, data = self.filled + n, data[n:]
            if self.filled == HUGE_PAGE:
                self._flush()

    def _flush(self) -> None:
        _write_all(self.fd, memoryview(self.piece)[:self.filled])
        self.filled = 0

    def __enter__(self) -> _HugePageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self._flush()
                os.fsync(self.fd)  # whole on the disk before the index names it
        finally:
            os.close(self.fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]
