"""The tensor-parallel ranks beyond the engine's own: started, fed every step, and watched by the engine (rank 0).

Why processes: each rank runs its products on its own cores with its own OpenMP threads, and one Python process
would serialize the ranks' steps on its interpreter. The engine keeps the scheduler, the block tables and sampling;
a worker holds only its part of the model and of the KV pool, and runs each step's forward as the engine sends it.

One socket pair per worker carries, in order:
- engine -> worker: its ``WorkerArgs``;
- worker -> engine: ``None`` once its model is loaded and packed, or the text of the error that stopped it;
- engine -> worker: the KV pool's block count (the engine sizes the pool once all weights are in);
- engine -> worker: each step's (input ids, positions, attention metadata), pickled once for all workers; ``None``
  to stop.
A worker stops when its socket closes or the engine process ends, however it ended. A worker that dies fails the
engine's next step (the check before it, or the sum in it, whose peer is gone) with an error naming the rank: the
engine process then ends and the server starts it again whole, ranks included, as after any engine crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.attention import AttentionMetadata
from engine.backends import select_backend
from engine.config import EngineConfig
from engine.kernel_plan import plan_kernels
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model_loader import load_config, resolve_model
from engine.models import load_model
from engine.tensor_parallel import AllReduce, Shard, make_shm_segment

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # prctl(2)
START_TIMEOUT_S = 1800  # a worker's load and packing (an 8B model's took ~70 s on the development machines)


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker must agree on with the engine; decided once by the engine (the dtype may be measured)."""

    config: EngineConfig
    rank: int
    store_path: str  # the process group's rendezvous file
    shm_path: str  # the shared-memory sums' segment (tensor_parallel.AllReduce)
    hidden: int
    dtype: torch.dtype
    max_model_len: int
    log_level: int


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Every rank on the host CPU, or rank r on GPU r."""
    device = config.resolve_device()
    return torch.device("cuda", rank) if device.type == "cuda" else device


def threads_per_rank(config: EngineConfig) -> int:
    """``num_threads`` if set, else the process's cores shared out evenly between the ranks."""
    return config.num_threads or max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


class TPWorkers:
    """The engine's handle on ranks 1..N-1: start them, join their process group, hand out the pool, run steps.

    Workers are plain subprocesses (``python -m engine.tp_workers``) over a socket pair, not ``multiprocessing``
    children: the server's engine process is a daemon, which ``multiprocessing`` forbids to have children."""

    def __init__(self, config: EngineConfig, hidden: int, dtype: torch.dtype, max_model_len: int) -> None:
        size = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="harpoon-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        store_path, self._shm_path = os.path.join(self._dir, "store"), os.path.join(self._dir, "sums")
        if rank_device(config, 0).type == "cpu":
            make_shm_segment(self._shm_path, size, hidden)
        env = dict(os.environ)  # the engine's package importable from wherever the server was started
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.processes: list[subprocess.Popen] = []
        self.pipes: list[Connection] = []
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen([sys.executable, "-m", "engine.tp_workers", str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], env=env)
            theirs.close()
            pipe = Connection(ours.detach())
            pipe.send(WorkerArgs(config, rank, store_path, self._shm_path, hidden, dtype, max_model_len,
                                 logging.getLogger().level))
            self.processes.append(process)
            self.pipes.append(pipe)
        self._rank_threads = threads_per_rank(config)
        self._all_threads = max(self._rank_threads, len(os.sched_getaffinity(0)))
        torch.set_num_threads(self._rank_threads)
        try:  # waits for every rank to join, then times the ways to sum
            self.all_reduce = AllReduce(store_path, self._shm_path, 0, size, rank_device(config, 0), hidden,
                                        self.alive)
        except RuntimeError as e:
            errors = self._start_errors()
            self.close()
            raise RuntimeError(f"tensor-parallel ranks did not join: {e}" + "".join(errors)) from None
        except BaseException:
            self.close()
            raise
        logger.info(self.all_reduce.describe())

    def wait_ready(self) -> None:
        """Once the engine's own part is loaded: wait for the workers' (they load theirs at the same time)."""
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.poll(START_TIMEOUT_S):
                raise RuntimeError(f"tensor-parallel rank {rank} did not load its part in {START_TIMEOUT_S} s")
            try:
                error = pipe.recv()
            except EOFError:
                error = f"it exited with code {self.processes[rank - 1].wait()}"
            if error is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {error}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._shm_path)  # every rank has it mapped: nothing is left behind however the engine ends

    def _start_errors(self) -> list[str]:
        """What the workers that stopped while starting said, if anything."""
        errors = []
        for rank, pipe in enumerate(self.pipes, start=1):
            with contextlib.suppress(EOFError, OSError):
                if pipe.poll(1.0) and (error := pipe.recv()) is not None:
                    errors.append(f"\nrank {rank}: {error}")
        return errors

    def allocate(self, num_blocks: int) -> None:
        for pipe in self.pipes:
            pipe.send(num_blocks)

    def dispatch(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Start the step on every worker; the engine then runs its own part, and the sums join them."""
        self.check_alive()
        torch.set_num_threads(self._rank_threads)
        data = pickle.dumps((input_ids, positions, meta), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(data)
            except OSError as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({e}); the engine must be restarted") from e

    def forward_done(self) -> None:
        """The step's layers are done: until the next step the other ranks wait, so the LM head, sampling and the
        scheduler here get every core the ranks share (an 8B model's LM head is 4% of its weights, read by one
        rank alone)."""
        torch.set_num_threads(self._all_threads)

    def alive(self) -> bool:
        return all(process.poll() is None for process in self.processes)

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {process.returncode}); "
                                   "the engine must be restarted")

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send_bytes(pickle.dumps(None))
            except OSError:
                pass  # that worker is gone already
            pipe.close()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def run_worker(args: WorkerArgs, pipe: Connection) -> None:
    """A worker's main: its part of the model, then steps until the engine says stop or goes away."""
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: "
                                                     "%(message)s")
    config = args.config
    try:
        torch.set_num_threads(threads_per_rank(config))
        device = rank_device(config, args.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds this rank's communicator to the current device
        engine_pid = os.getppid()
        all_reduce = AllReduce(args.store_path, args.shm_path, args.rank, config.tensor_parallel_size, device,
                               args.hidden, lambda: os.getppid() == engine_pid)
        files = resolve_model(config.model)
        shard = Shard(args.rank, config.tensor_parallel_size, load_config(files))
        backend = select_backend(config, device, args.dtype)
        model = load_model(files, shard.config, args.max_model_len, backend, device, args.dtype, shard, all_reduce)
        plan_kernels(backend)  # this rank's open choices, timed on its own part of each weight as rank 0 times its
        pipe.send(None)
    except Exception as e:  # noqa: BLE001 - the engine reports it, with this rank's traceback
        pipe.send(f"{e}\n{traceback.format_exc()}")
        return
    try:
        num_blocks = pipe.recv()
        kv_dtype = config.resolve_kv_cache_dtype(args.dtype, device)
        spec = KVCacheSpec.of_model(model.config, config.block_size, kv_dtype)
        kv_cache = KVCache(spec, num_blocks, device)
        with torch.inference_mode():
            while (step := pickle.loads(pipe.recv_bytes())) is not None:
                input_ids, positions, meta = step
                backend.forward(model, input_ids, positions, kv_cache.layers, meta)
    except EOFError:
        pass  # the engine went away: nothing left to run


def main() -> None:
    """``python -m engine.tp_workers FD``: a worker over the socket inherited as FD (``TPWorkers``)."""
    # NOTE: killed with the engine process however it ends (a SIGKILL included), not only when its socket closes.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    pipe = Connection(int(sys.argv[1]))
    try:
        args = pipe.recv()
    except EOFError:
        return
    run_worker(args, pipe)


if __name__ == "__main__":
    main()
