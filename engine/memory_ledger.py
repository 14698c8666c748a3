"""Where the engine process's memory went: the weights, the KV pool, the step's workspace and the runtime, each
counted from what the engine holds, set against what the OS (and on a GPU the driver) reports.

RSS alone says how much, not why. A user sizing ``--kv-cache-memory``, or wondering why a 4 GB model takes 6, needs
the parts; and a part that grows where none of them did (a leak) shows up in the remainder, which is printed rather
than folded into a part. Nothing here is inferred from RSS except what says so:
- weights: every tensor reachable from the model and the backend (parameters, packed panels, prepacked oneDNN
  weights, the greedy head's int8 copy, rotary tables), each storage counted once;
- KV pool: the formula 2 x layers x tokens x kv_heads x head_dim x bytes, checked against the pool's tensors;
- workspace: the largest transient during the warm-up steps, which run the largest step the engine will run: the
  peak resident set above what was resident before them (the C heap trimmed first, and the peak reset through
  ``/proc/self/clear_refs``), or on a GPU the allocator's peak above what it held before them;
- CUDA graphs: the memory pool the captures reserved;
- runtime (host): resident before the model was built: the interpreter and torch (the tokenizer is built later, with
  the first grammar, if ever).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

MiB = 1 << 20
_MAX_DEPTH = 8  # how far the walk from the model and the backend follows attributes to find tensors


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_field("VmRSS")


def peak_rss_bytes() -> int:
    """The most this process has had resident since it began, or since ``reset_peak_rss`` (VmHWM)."""
    return _status_field("VmHWM")


def reset_peak_rss() -> bool:
    """Start VmHWM again from the current RSS; False where the kernel does not allow it (then the peak is the
    process's whole life)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_malloc() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``), so that memory freed earlier (the
    weights as loaded, before packing) cannot hide a transient from the peak; a no-op without glibc."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _status_field(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} in /proc/self/status")


def held_tensor_bytes(roots: Iterable[object], device: torch.device, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct tensor storages on ``device`` reachable from ``roots`` through modules, dataclasses,
    containers, ``functools.partial`` and the attributes of Harpoon's own objects, leaving out those of ``exclude``."""
    seen_storage: set[tuple[str, int]] = {_storage_key(t)[0] for t in exclude}
    seen_objects: set[int] = set()
    total = 0

    def visit(obj: object, depth: int) -> None:
        nonlocal total
        if depth > _MAX_DEPTH or id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != device.type:
                return
            key, nbytes = _storage_key(obj)
            if key not in seen_storage:
                seen_storage.add(key)
                total += nbytes
            return
        for child in _children(obj):
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return total


def _storage_key(t: torch.Tensor) -> tuple[tuple[str, int], int]:
    if t.is_mkldnn:  # an opaque prepacked weight: no storage to share, its elements are its size
        return ("mkldnn", id(t)), t.numel() * t.element_size()
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr()), storage.nbytes()


def _children(obj: object) -> Iterable[object]:
    if isinstance(obj, torch.nn.Module):
        yield from obj.parameters(recurse=False)
        yield from obj.buffers(recurse=False)
        yield from obj.children()
        yield from (v for k, v in vars(obj).items() if not k.startswith("_"))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield from (getattr(obj, f.name) for f in dataclasses.fields(obj))
    elif type(obj).__module__.split(".")[0] in ("engine", "kernels") and hasattr(obj, "__dict__"):
        yield from vars(obj).values()


@dataclass(frozen=True)
class MemoryLedger:
    """The parts (bytes) and what was measured. ``measured`` is the host's RSS on a CPU and the device memory in
    use (the driver's view) on a GPU; the parts set against it are those that live there."""

    device: str
    weights: int
    kv_pool: int
    kv_formula: str
    workspace: int
    workspace_source: str
    cuda_graphs: int
    runtime: int  # host RSS before the model was built
    host_rss: int
    device_used: int | None = None  # total - free, as the driver reports it (every process on the device)
    device_reserved: int | None = None  # held by torch's caching allocator

    @property
    def on_gpu(self) -> bool:
        return self.device_used is not None

    def parts(self) -> dict[str, int]:
        if self.on_gpu:
            return {"weights": self.weights, "kv_pool": self.kv_pool, "workspace": self.workspace,
                    "cuda_graphs": self.cuda_graphs}
        return {"runtime": self.runtime, "weights": self.weights, "kv_pool": self.kv_pool,
                "workspace": self.workspace}

    @property
    def measured(self) -> int:
        return self.device_used if self.device_used is not None else self.host_rss

    @property
    def remainder(self) -> int:
        """What the OS or driver reports beyond the parts: allocator caches, a CUDA context, a leak. Negative where
        the workspace's peak was handed back."""
        return self.measured - sum(self.parts().values())

    def refreshed(self) -> MemoryLedger:
        """The same parts against what is measured now."""
        used, reserved = _device_memory(self.device)
        return dataclasses.replace(self, host_rss=rss_bytes(), device_used=used, device_reserved=reserved)

    def as_json(self) -> dict:
        return {
            "device": self.device,
            "parts": self.parts(),
            "kv_formula": self.kv_formula,
            "workspace_source": self.workspace_source,
            "measured": {"what": "device memory in use (driver)" if self.on_gpu else "process RSS",
                         "bytes": self.measured},
            "remainder": self.remainder,
            "host_rss": self.host_rss,
            "runtime": self.runtime,
            "device_reserved": self.device_reserved,
        }

    def lines(self) -> list[str]:
        """The ledger as log lines, MiB to one decimal."""
        measured = "device memory in use (driver)" if self.on_gpu else "process RSS"
        out = [f"memory ({self.device}):"]
        for name, value in self.parts().items():
            note = {"kv_pool": self.kv_formula, "workspace": self.workspace_source}.get(name, "")
            out.append(f"  {name:<12}{value / MiB:10.1f} MiB  {note}".rstrip())
        out.append(f"  {'remainder':<12}{self.remainder / MiB:10.1f} MiB  (allocator caches, "
                   f"{'CUDA context, other processes' if self.on_gpu else 'freed workspace, fragmentation'})")
        out.append(f"  {'= ' + measured:<12}{self.measured / MiB:10.1f} MiB")
        if self.on_gpu:
            out.append(f"  host RSS {self.host_rss / MiB:.1f} MiB (runtime before the model {self.runtime / MiB:.1f})")
        return out


def _device_memory(device: str) -> tuple[int | None, int | None]:
    if not device.startswith("cuda"):
        return None, None
    dev = torch.device(device)
    free, total = torch.cuda.mem_get_info(dev)
    return total - free, torch.cuda.memory_reserved(dev)


class LedgerProbe:
    """Measures the runtime before the model is built and the workspace around the warm-up steps (``measure``
    wraps them), then writes the ledger."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.runtime = rss_bytes()
        self.workspace = 0
        self.workspace_source = "not measured"

    def measure_workspace(self, warm_up: Callable[[], None]) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            warm_up()
            self.workspace = max(0, torch.cuda.max_memory_allocated(self.device) - before)
            self.workspace_source = "allocator peak above its holdings, over the warm-up steps"
            return
        trim_malloc()
        before = rss_bytes()
        reset = reset_peak_rss()
        warm_up()
        if reset:
            self.workspace = max(0, peak_rss_bytes() - before)
            self.workspace_source = "peak RSS above the RSS before them, over the warm-up steps"
        else:
            self.workspace_source = "not measured (/proc/self/clear_refs refused)"

    def ledger(self, weights: int, kv_pool: int, kv_formula: str, cuda_graphs: int) -> MemoryLedger:
        return MemoryLedger(
            device=str(self.device), weights=weights, kv_pool=kv_pool, kv_formula=kv_formula,
            workspace=self.workspace, workspace_source=self.workspace_source, cuda_graphs=cuda_graphs,
            runtime=self.runtime, host_rss=0,
        ).refreshed()


def process_memory() -> dict[str, int]:
    """This process's RSS and peak, for the API process's side of ``/debug/memory``."""
    return {"pid": os.getpid(), "rss": rss_bytes(), "peak_rss": peak_rss_bytes()}
