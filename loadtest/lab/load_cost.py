"""What loading a model costs a server: seconds until healthy, the peak resident memory of the server's whole
process tree (API and engine processes) while it loads and serves, and, for scale, the seconds to read the file
once. Then a short c1 run for the token rate.

    python -m loadtest.lab.load_cost --model ~/.cache/harpoon/random-models/llama-3.2-1b-q4_k_m-seed0.gguf

The figures set the targets of a GGUF loader (peak RSS against the file's size, load time against one read: the
whole start's and the engine's load step's, from its config to its last weight packed or mapped), and the c1
decode's rate of reading the weights (the engine's ledger of packed weights over the time per token) against the
machine's measured read bandwidth. A GGUF file's second start maps the panels its first start kept
(``engine/backends/panel_cache.py``); ``--serve-args "... --no-panel-cache"`` packs them again.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch

from engine.backends.panel_cache import MIN_BYTES
from loadtest.processes import start, stop, wait_healthy
from loadtest.serve import BenchConfig, benchmark_point, load_tokenizer

_PAGE = os.sysconf("SC_PAGE_SIZE")


def process_rss(pid: int) -> dict[int, int]:
    """Resident bytes of ``pid`` and of each of its descendants, now."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                found[p] = int(f.read().split()[1]) * _PAGE
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants, now."""
    return sum(process_rss(pid).values())


def model_files(path: Path) -> list[Path]:
    """The file, or a folder's weight files."""
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def read_seconds(path: Path) -> float:
    """Seconds to read the weights once into one reused buffer: from the page cache on a second start, from the disk
    after ``drop_page_cache``. NOTE: reading into a new 64 MiB object each time took 3.9 s over an 8B Q4_K_M file
    that ``cat`` read in 0.6 s: the fresh memory's page faults, not the read."""
    buffer = bytearray(64 << 20)
    started = time.perf_counter()
    for file in model_files(path):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - started


def wait_for_log(log: Path, pattern: str, timeout: float) -> bool:
    """Whether a line matching ``pattern`` is in ``log`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text()):
            return True
        time.sleep(0.5)
    return False


def drop_page_cache() -> None:
    """Every clean page of the page cache dropped (root only), so the next read of a file comes from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError as e:
        raise SystemExit(f"--cold needs to drop the page cache, which takes root: {e}") from None


def read_bandwidth() -> float:
    """Bytes/s of a streaming read on this CPU: torch's sum over 2 GiB, the best of 5 (the ceiling a c1 decode, which
    reads every weight once a token, can approach)."""
    x = torch.ones(1 << 29)
    x.sum()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - started)
    return x.numel() * 4 / min(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a .gguf file or a Hugging Face folder")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--serve-args", default="--max-model-len 2048 --kv-cache-memory 1GiB")
    p.add_argument("--prompts", type=int, default=4, help="c1 requests of 128 in / 128 out after loading")
    p.add_argument("--cold", action="store_true",
                   help="drop the page cache before the read and before the server starts (a first start; root)")
    p.add_argument("--llama-server", metavar="BIN",
                   help="then the same for llama.cpp's llama-server (loadtest/llama_cpp_setup.sh) on the same file, "
                        "started as gguf_side_by_side.sh starts it for 16 clients")
    args = p.parse_args(argv)
    path = Path(args.model).expanduser()
    size = sum(f.stat().st_size for f in model_files(path))
    bandwidth = read_bandwidth()
    if args.cold:
        drop_page_cache()
    read_s = read_seconds(path)
    if args.cold:
        drop_page_cache()
    harpoon = [sys.executable, "-m", "server", "--port", str(args.port), "--model", str(path), "--log-level", "info",
               *args.serve_args.split()]
    log, tpot = _measure("harpoon", harpoon, args, path, size, read_s, bandwidth)
    if args.llama_server:
        if args.cold:
            drop_page_cache()
        _measure("llama-server", [args.llama_server, "--model", str(path), "--host", "127.0.0.1", "--port",
                                  str(args.port), "--threads", str(os.cpu_count()), "--parallel", "16",
                                  "--cont-batching", "--ctx-size", str(2048 * 16)], args, path, size, read_s,
                 bandwidth)
    _report_engine(log, tpot, read_s, size, bandwidth)


def _measure(label: str, command: list[str], args: argparse.Namespace, path: Path, size: int, read_s: float,
             bandwidth: float) -> tuple[Path, float]:
    """Start ``command``, time it to healthy, sample its process tree's RSS through a short c1 run; print the
    figures; its log's path and its c1 seconds a token."""
    log = Path(f"/tmp/load_cost_{label}_{args.port}.log")
    started = time.perf_counter()
    server = start(command, log)
    peak, done = [0], threading.Event()
    each: dict[int, int] = {}  # peak of every process of the tree

    def sample() -> None:
        while not done.is_set():
            now = process_rss(server.pid)
            peak[0] = max(peak[0], sum(now.values()))
            for pid, rss in now.items():
                each[pid] = max(each.get(pid, 0), rss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        wait_healthy(f"http://127.0.0.1:{args.port}", server, log, timeout=1800)
        load_s = time.perf_counter() - started
        load_peak = peak[0]
        cfg = BenchConfig(base_url=f"http://127.0.0.1:{args.port}", num_prompts=args.prompts, input_len=128,
                          output_len=128, max_concurrency=1, num_warmups=0)
        summary = benchmark_point(cfg, load_tokenizer(None), None, progress=False)["summary"]
        if size >= MIN_BYTES and label == "harpoon":  # a first start writes its cache file while it serves
            wait_for_log(log, r"panel_cache: panels (of .* (mapped from|cached in)|not cached)", 600)
    finally:
        done.set()
        stop([server])
    gib = 2**30
    print(f"== {label}: file {size / gib:.2f} GiB, read once in {read_s:.1f} s "
          f"({'from the disk' if args.cold else 'page cache'})")
    print(f"healthy after {load_s:.1f} s ({load_s / max(read_s, 1e-3):.0f}x one read); peak RSS while loading "
          f"{load_peak / gib:.2f} GiB ({load_peak / size:.1f}x the file), while serving {peak[0] / gib:.2f} GiB")
    engine_peak = max((rss for pid, rss in each.items() if pid != server.pid), default=0)
    print(f"peak RSS of the engine process (which loads the model) {engine_peak / gib:.2f} GiB "
          f"({engine_peak / size:.2f}x the file), of the API process {each.get(server.pid, 0) / gib:.2f} GiB")
    tpot = summary["tpot_ms"]["median"] / 1000
    print(f"c1, 128 in / 128 out: TPOT p50 {tpot * 1000:.1f} ms, TTFT p50 "
          f"{summary['ttft_ms']['median']:.0f} ms, {summary['output_throughput']:.1f} tok/s")
    return log, tpot


def _report_engine(log: Path, tpot: float, read_s: float, size: int, bandwidth: float) -> None:
    """What Harpoon's log says of its load, and its c1 decode's rate of reading the weights."""
    text = log.read_text()
    loaded = re.search(r"engine_core: loaded .* in ([\d.]+) s", text)
    if loaded:
        load_step = float(loaded.group(1))
        panels = re.search(r"panel_cache: panels of .* (mapped from|cached in) ", text)
        how = {"mapped from": ", panels mapped", "cached in": ", panels packed and cached"}.get(
            panels.group(1) if panels else "", "")
        print(f"load step {load_step:.1f} s{how} ({load_step / max(read_s, 1e-3):.1f}x one read)")
        written = re.search(r"panel_cache: panels of .* cached in .*: ([\d.]+) MiB in ([\d.]+) s", text)
        if written:
            print(f"cache file written while serving: {float(written.group(1)):.0f} MiB in {written.group(2)} s")
    weights = re.search(r"weights\s+([\d.]+) MiB", text)
    active = re.search(r"a token reads ([\d.]+) MiB", text)  # a mixture of experts': its chosen experts only
    if active:
        rate = float(active.group(1)) * 2**20 / tpot
        print(f"a token reads {float(active.group(1)):.0f} MiB of the packed weights (k of E experts), at "
              f"{rate / 1e9:.1f} GB/s: {rate / bandwidth:.0%} of the measured {bandwidth / 1e9:.1f} GB/s")
    elif weights:
        rate = float(weights.group(1)) * 2**20 / tpot
        print(f"weights {float(weights.group(1)):.0f} MiB packed ({float(weights.group(1)) * 2**20 / size:.2f}x the "
              f"file), read at {rate / 1e9:.1f} GB/s a token: {rate / bandwidth:.0%} of the measured "
              f"{bandwidth / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
