"""The preallocated paged KV pool: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim]
(for an int8 pool, each head's row also holds its scale: ``kernels/kv_int8.py``)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from engine.models.llama import head_dim_of, num_kv_heads_of
from kernels.cpu.pages import HUGE_PAGE, advise_huge_pages
from kernels.kv_int8 import SCALE_BYTES, row_width


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def row_width(self) -> int:
        """Elements of a pool's last dimension (a head of one position)."""
        return row_width(self.head_dim, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        # K and V, for every layer.
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @classmethod
    def of_model(cls, config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The pool a model of ``config`` needs (under tensor parallelism, a rank's model: its KV heads only)."""
        return cls(config.num_hidden_layers, num_kv_heads_of(config), head_dim_of(config), block_size, dtype)

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


def available_memory(device: torch.device) -> int:
    """Bytes that could still be allocated on ``device``: free GPU memory, or MemAvailable on the host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def host_pools(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """``count`` zeroed host tensors of ``shape`` in one private anonymous mapping, advised onto 2 MiB pages before
    anything touches it, returned with the mapping, which must outlive them. Why: a decode step reads each sequence's
    blocks from all over the pool, and the loads that first touch each block were 68% of a 64-sequence decode
    attention's samples; on 2 MiB pages that attention took ~7% less time (docs/history/benchmarks-2026-12.md). Advised
    after torch had zeroed the pages, almost none became huge pages. Where 2 MiB pages are off, or the kernel refuses
    the advice, these are plain pages and nothing else changes."""
    each = torch.Size(shape).numel() * dtype.itemsize
    each += -each % 64  # each pool on a cache line of its own
    mapping = mmap.mmap(-1, count * each + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE  # the pools from a 2 MiB boundary, so whole huge pages cover them
    advise_huge_pages(buffer.data_ptr(), buffer.nbytes)
    pools = [buffer[start + i * each: start + i * each + torch.Size(shape).numel() * dtype.itemsize]
             .view(dtype).view(shape) for i in range(count)]
    for pool in pools:  # written now, as torch.zeros would: the pool is resident from the start, not at the first OOM
        pool.zero_()
    return mapping, pools


class KVCache:
    """Holds the pools. Zero-initialised so that slots never written hold finite values (masked reads stay finite)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget is smaller than one block ({spec.bytes_per_block} bytes); raise kv_cache_memory"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
        if device.type == "cpu":
            self._mapping, pools = host_pools(2 * spec.num_layers, shape, spec.dtype)
            self.layers: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(pools[0::2], pools[1::2], strict=True))
        else:
            self.layers = [(torch.zeros(shape, dtype=spec.dtype, device=device),
                            torch.zeros(shape, dtype=spec.dtype, device=device)) for _ in range(spec.num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.spec.bytes_per_token

    def formula(self) -> str:
        """The pool's size as the product it is: 2 (K and V) x layers x tokens x kv_heads x head_dim x bytes."""
        s = self.spec
        row = f"{s.head_dim} head_dim"
        if s.row_width != s.head_dim:
            row = f"({row} + {SCALE_BYTES} scale)"
        return (f"2 x {s.num_layers} layers x {self.num_tokens} tokens x {s.num_kv_heads} kv_heads x {row} x "
                f"{s.dtype.itemsize} B")

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.spec.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.num_bytes / 2**20:.1f} MiB ({self.spec.dtype}, {self.spec.num_layers} layers, "
            f"{self.spec.num_kv_heads} KV heads x {self.spec.head_dim})"
        )
