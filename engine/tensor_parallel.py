"""Tensor parallelism within one host: what each rank holds of the model, and the sum that joins their products.

Megatron's split of a decoder layer: every rank holds 1/N of the attention heads (q/k/v split by rows, their KV
heads with them) and of the MLP's gate/up columns, so attention and the activation run on each rank's own slice
without talking; o_proj and down_proj are split by their inputs, so each rank's product is a partial sum of the full
output, and one all-reduce per projection makes the residual stream whole again on every rank (two a layer).
Embeddings, norms and the LM head are replicated; only rank 0 samples. Where the model has fewer KV heads than
ranks, each KV head is replicated on N / num_kv_heads ranks, as vLLM does.

The sum runs over ``torch.distributed``'s process groups (NCCL on CUDA, gloo on a CPU), made privately per engine
(no global default group), so one process may build and drop engines as often as it likes; on a CPU, through a
shared-memory segment in C where that measures faster at start (``AllReduce``).
"""

from __future__ import annotations

import copy
import datetime
import mmap
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from engine.models.llama import head_dim_of, num_kv_heads_of
from engine.models.quantized import Blocks
from kernels import cpu as cpu_kernels

# A collective that waits longer than this on a peer raises instead of hanging: a rank that stopped without closing
# its sockets (a hung worker). A step's ranks reach each all-reduce within one layer's compute of each other.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
SHM_SLOT_ROWS = 256  # activation rows a shared-memory sum takes at a time (longer steps go in pieces)
SHM_WAIT_S = 1.0  # a shared-memory sum waits this long before it checks that its peers live
CHOICE_REPS = 20  # sums each way is timed over at start
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=60)  # for every rank to start and join (a worker imports torch first)

_ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # outputs split: each rank its rows
_INPUT_SPLIT = ("o_proj", "down_proj")  # inputs split: each rank a partial sum, all-reduced


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: which heads and MLP columns it holds of a model of ``config``'s shape."""

    rank: int
    size: int
    config: PretrainedConfig  # the whole model's

    def __post_init__(self) -> None:
        check_divisible(self.config, self.size)

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, num_kv_heads_of(self.config) // self.size)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    def _width(self, name: str) -> int:
        """The whole MLP width of the projection ``name`` (a dense MLP's, an expert's or the shared expert's)."""
        if ".shared_expert." in name:
            return self.config.shared_expert_intermediate_size
        if ".experts." in name and getattr(self.config, "moe_intermediate_size", None):
            return self.config.moe_intermediate_size  # Qwen's; Mixtral's experts are intermediate_size wide
        return self.config.intermediate_size

    def model_config(self) -> PretrainedConfig:
        """The config this rank's model is built from: its heads and MLP columns, the hidden size unchanged."""
        config = copy.deepcopy(self.config)
        config.head_dim = head_dim_of(self.config)  # no longer hidden_size // heads once the heads are split
        config.num_attention_heads = self.num_heads
        config.num_key_value_heads = self.num_kv_heads
        config.intermediate_size = self.intermediate_size
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # experts split by their columns
            if getattr(self.config, key, None):
                setattr(config, key, getattr(self.config, key) // self.size)
        return config

    def weights(
        self, weights: Iterator[tuple[str, torch.Tensor | Blocks]]
    ) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
        """A checkpoint's tensors (Hugging Face names) cut to this rank's part; the replicated ones whole."""
        for name, tensor in weights:
            parts = name.split(".")
            layer = parts[-2] if len(parts) >= 2 else ""
            if layer in _ROW_SPLIT:
                start, stop = self._output_rows(layer, self._width(name) // self.size)
                yield name, tensor.rows(slice(start, stop)) if not isinstance(tensor, torch.Tensor) \
                    else tensor[start:stop]
            elif layer in _INPUT_SPLIT and parts[-1] == "weight":
                start, stop = self._input_columns(layer, self._width(name) // self.size)
                yield name, tensor.columns(start, stop) if not isinstance(tensor, torch.Tensor) \
                    else tensor[:, start:stop]
            else:  # embeddings, norms, the LM head, and o/down biases (added once, after the sum)
                yield name, tensor

    def _output_rows(self, layer: str, width: int) -> tuple[int, int]:
        head_dim = head_dim_of(self.config)
        if layer == "q_proj":
            return self.rank * self.num_heads * head_dim, (self.rank + 1) * self.num_heads * head_dim
        if layer in ("k_proj", "v_proj"):
            first = self.rank * num_kv_heads_of(self.config) // self.size  # replicated: ranks share a head
            return first * head_dim, (first + self.num_kv_heads) * head_dim
        return self.rank * width, (self.rank + 1) * width

    def _input_columns(self, layer: str, width: int) -> tuple[int, int]:
        width = self.num_heads * head_dim_of(self.config) if layer == "o_proj" else width
        return self.rank * width, (self.rank + 1) * width


def check_divisible(config: PretrainedConfig, size: int) -> None:
    """ValueError unless a model of ``config``'s shape splits evenly over ``size`` ranks."""
    heads, kv_heads = config.num_attention_heads, num_kv_heads_of(config)
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"its {kv_heads} KV heads (a divisor or a multiple of the size is needed)")
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        width = getattr(config, key, None)
        if width and width % size:
            problems.append(f"its {key} {width}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide {' or '.join(problems)}")


class AllReduce:
    """In-place sums across the ranks, in one of two ways, both made at start and the faster kept:
    - ``gloo`` (``nccl`` on CUDA, where it is the only way): a private ``torch.distributed`` process group;
    - ``shm``, on a CPU with the C kernels: the ranks' shared segment (``kernels/cpu/shm_sum.c``).
    Every rank times both on the same calls right after joining; rank 0's verdict is broadcast, so all ranks take
    the same way. The group also carries that broadcast."""

    def __init__(self, store_path: str, shm_path: str, rank: int, size: int, device: torch.device, hidden: int,
                 peers_alive: Callable[[], bool]) -> None:
        store = torch.distributed.FileStore(store_path, size)
        store.set_timeout(RENDEZVOUS_TIMEOUT)
        if device.type == "cuda":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self.group = torch.distributed.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.group = torch.distributed.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        self.rank, self.size = rank, size
        self.shm = _ShmSum(shm_path, rank, size, SHM_SLOT_ROWS * hidden, peers_alive) \
            if device.type == "cpu" and cpu_kernels.available() else None
        self.timings: dict[str, float] = {}  # way -> seconds a [1, hidden] sum took at start (median)
        self.way = "nccl" if device.type == "cuda" else "gloo"
        self._sum: Callable[[torch.Tensor], None] = self._group_sum
        if self.shm is not None:
            self._choose(hidden)
        self.num_calls = 0
        self.seconds = 0.0  # time in the sums, waiting for the slowest rank included (loadtest.lab.tensor_parallel)

    def __call__(self, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            self._sum(tensor)
        except RuntimeError as e:
            raise RuntimeError(f"tensor-parallel sum failed on rank {self.rank} (a rank died or hung): {e}") from e
        self.seconds += time.perf_counter() - start
        self.num_calls += 1

    def _group_sum(self, tensor: torch.Tensor) -> None:
        self.group.allreduce([tensor]).wait()

    def _choose(self, hidden: int) -> None:
        x = torch.empty(1, hidden)
        for way, run in (("gloo", self._group_sum), ("shm", self.shm)):
            times = []
            for _ in range(CHOICE_REPS):
                x.fill_(self.rank + 1)
                start = time.perf_counter()
                run(x)
                times.append(time.perf_counter() - start)
            if not bool((x == self.size * (self.size + 1) / 2).all()):
                raise RuntimeError(f"the {way} sum across {self.size} ranks gave a wrong result")
            self.timings[way] = statistics.median(times)
        verdict = torch.tensor([int(self.timings["shm"] < self.timings["gloo"])])
        self.group.broadcast([verdict], torch.distributed.BroadcastOptions()).wait()  # rank 0's, for every rank
        if verdict.item():
            self.way, self._sum = "shm", self.shm

    def describe(self) -> str:
        timed = ", ".join(f"{way} {t * 1e6:.0f} us" for way, t in self.timings.items())
        return f"tensor-parallel sums over {self.way}" + (f" (a [1, hidden] sum at start: {timed})" if timed else "")


def make_shm_segment(path: str, size: int, hidden: int) -> None:
    """The shared-memory sums' segment for ``size`` ranks of a model ``hidden`` wide, all zeros (every flag at
    generation 0): made by the engine before any rank maps it. Nothing if the C kernels are missing."""
    if not cpu_kernels.available():
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, cpu_kernels.shm_sum_bytes(size, SHM_SLOT_ROWS * hidden))
    finally:
        os.close(fd)


class _ShmSum:
    """The ranks' shared segment (a file under /dev/shm the engine makes and removes) and this rank's calls into it.
    Calls longer than a slot go a slot at a time; a wait past ``SHM_WAIT_S`` asks whether the peers live before it
    goes on, so a dead rank fails the sum instead of hanging it."""

    def __init__(self, path: str, rank: int, size: int, slot: int, peers_alive: Callable[[], bool]) -> None:
        self.rank, self.size, self.slot, self.peers_alive = rank, size, slot, peers_alive
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, cpu_kernels.shm_sum_bytes(size, slot))
        finally:
            os.close(fd)
        self.view = torch.frombuffer(self.map, dtype=torch.uint8)  # keeps the address valid
        self.generation = 0

    def __call__(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), self.slot):
            self.generation += 1
            part = flat[start:start + self.slot]
            while not cpu_kernels.shm_sum(self.view.data_ptr(), self.rank, self.size, self.slot, part,
                                          self.generation, SHM_WAIT_S):
                if not self.peers_alive():
                    raise RuntimeError("a rank stopped before the shared-memory sum")
