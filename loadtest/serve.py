"""Serving benchmark against Harpoon or any OpenAI-compatible server (flags named as in ``vllm bench serve``).

    python -m loadtest.serve --num-prompts 64 --input-len 128 --output-len 128 --max-concurrency 16
    python -m loadtest.serve --sweep-concurrency 1,4,16,64 --save results/sweep.json --plot-dir results/
    python -m loadtest.serve --sweep-concurrency 1,16 --compare http://127.0.0.1:8100   # side by side

Each sweep point runs max(--num-prompts, 2 x concurrency) requests, drawn with its own seed (--seed + its index,
the same for every server). Metrics are defined in loadtest/metrics.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from engine.outputs import STEP_PHASES
from loadtest.client import request_body, send, session
from loadtest.datasets import BenchRequest, build_requests
from loadtest.metrics import parse_goodput, records_as_dicts, summarize


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 1000
    num_prefixes: int = 1  # the prefix dataset's distinct prefixes
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0
    num_warmups: int = 1
    ignore_eos: bool = True
    temperature: float = 0.0  # greedy by default; > 0 samples (every step then needs the full logits)
    request_timeout: float = 600.0
    health_timeout: float = 300.0
    tokenizer: str | None = None


async def wait_healthy(http: aiohttp.ClientSession, base_url: str, timeout: float) -> None:
    """Until ``/health`` answers 200, or, on a server without that route (llama-cpp-python's answers 404),
    ``/v1/models`` does."""
    deadline, path = time.monotonic() + timeout, "/health"
    while True:
        try:
            async with http.get(base_url + path, timeout=aiohttp.ClientTimeout(total=5)) as response:
                if response.status == 200:
                    return
                if response.status == 404 and path == "/health":
                    path = "/v1/models"
                    continue
        except (aiohttp.ClientError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}{path} did not answer 200 within {timeout:.0f} s")
        await asyncio.sleep(0.5)


async def served_model(http: aiohttp.ClientSession, base_url: str) -> str:
    async with http.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=60)) as response:
        data = await response.json(content_type=None)  # a router may send JSON as text/plain
    return data["data"][0]["id"]


async def _arrivals(requests: list[BenchRequest], rate: float, burstiness: float, seed: int):
    """Yield requests at Poisson (burstiness 1) or gamma-distributed intervals; all at once if rate is inf."""
    rng = np.random.default_rng(seed)
    for request in requests:
        yield request
        if rate != float("inf"):
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def run(cfg: BenchConfig, requests: list[BenchRequest], progress: bool = True) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    base_url = cfg.base_url.rstrip("/")
    url = base_url + cfg.endpoint
    async with session(headers) as http:
        await wait_healthy(http, base_url, cfg.health_timeout)
        model = cfg.model or await served_model(http, base_url)
        for i in range(cfg.num_warmups):
            warm = replace(requests[i % len(requests)], output_len=min(16, requests[0].output_len))
            body = request_body(cfg.endpoint, model, warm, cfg.ignore_eos, cfg.temperature)
            await send(http, url, body, 0.0, cfg.request_timeout)
        before = await idle_engine_metrics(http, base_url)
        semaphore = asyncio.Semaphore(cfg.max_concurrency or len(requests))
        bar = tqdm(total=len(requests), desc=f"{cfg.base_url} c={cfg.max_concurrency or 'inf'}", disable=not progress,
                   file=sys.stderr, leave=False)
        bench_start = time.perf_counter()

        async def one(request: BenchRequest):
            async with semaphore:
                body = request_body(cfg.endpoint, model, request, cfg.ignore_eos, cfg.temperature)
                record = await send(http, url, body, bench_start, cfg.request_timeout, request.prompt_len)
            bar.update(1)
            return record

        tasks = []
        async for request in _arrivals(requests, cfg.request_rate, cfg.burstiness, cfg.seed):
            tasks.append(asyncio.create_task(one(request)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
        bar.close()
        after = await engine_metrics(http, base_url)
    profile = step_profile(before, after, duration) if before and after else None
    engine = after.get("engine") if after else None
    return {"model": model, "records": records, "duration": duration, "step_profile": profile, "engine": engine}


async def engine_metrics(http: aiohttp.ClientSession, base_url: str) -> dict | None:
    """Harpoon's own series from /metrics (``name`` or ``name{phase}``: a float; ``engine``: the labels of its info
    series, device, dtype, backend, ISA and GEMM choice), or None for a server without them."""
    try:
        async with http.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            text = await response.text() if response.status == 200 else ""
    except aiohttp.ClientError:
        return None
    values = {}
    for line in text.splitlines():
        if not line.startswith("harpoon:") or "_bucket" in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{", 1)[0].removeprefix("harpoon:")
        if key == "engine_info":
            values["engine"] = dict(re.findall(r'(\w+)="([^"]*)"', name))
            continue
        if 'phase="' in name:
            key += "{" + name.split('phase="', 1)[1].split('"', 1)[0] + "}"
        values[key] = float(value)
    return values or None


async def idle_engine_metrics(http: aiohttp.ClientSession, base_url: str, timeout: float = 30.0) -> dict | None:
    """``engine_metrics`` once the engine has no request (or after ``timeout``): a step still running for an earlier
    request (one a client gave up on, a warm-up) would count in full in a window it began before."""
    deadline = time.monotonic() + timeout
    while True:
        values = await engine_metrics(http, base_url)
        if values is None or time.monotonic() > deadline or (
                values.get("num_requests_running", 0) == 0 and values.get("num_requests_waiting", 0) == 0):
            return values
        await asyncio.sleep(0.25)  # a reading costs the server ~2.5 ms (its histograms rendered): not too often


def step_profile(before: dict[str, float], after: dict[str, float], duration: float) -> dict | None:
    """Where the engine's time went during a run, from two readings of /metrics: steps, their size, ms per step by
    phase, the share of the run the engine was busy, and the GEMM rate of its steps (against the peak it measured
    at start-up, where it did)."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = delta("engine_steps_total")
    if steps <= 0:
        return None
    phases = {p: delta(f"engine_busy_seconds_total{{{p}}}") for p in (*STEP_PHASES, "send")}
    busy = sum(phases.values())
    step_s = busy - phases["send"]
    profile = {"steps": int(steps), "tokens_per_step": delta("engine_step_tokens_total") / steps,
               "decodes_per_step": delta("engine_step_decode_tokens_total") / steps,
               "ms_per_step": 1000 * busy / steps, "busy_share": busy / duration,
               "share": {p: v / busy for p, v in phases.items()} if busy else {},
               "python_share": (phases["schedule"] + phases["prepare"] + phases["update"] + phases["send"]) / busy
               if busy else 0.0,
               "gemm_gflops": delta("engine_gemm_flops_total") / step_s / 1e9 if step_s > 0 else 0.0}
    peak = after.get("gemm_peak_flops")
    if peak:
        profile["gemm_peak_gflops"] = peak / 1e9
        profile["gemm_share_of_peak"] = profile["gemm_gflops"] * 1e9 / peak
    return profile


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(path or resolve_model(None).path)


def benchmark_point(cfg: BenchConfig, tokenizer, goodput: dict | None, progress: bool = True) -> dict:
    requests = build_requests(cfg.dataset, tokenizer, cfg.num_prompts, cfg.input_len, cfg.output_len,
                              cfg.range_ratio, cfg.prefix_len, cfg.seed, cfg.num_prefixes)
    result = asyncio.run(run(cfg, requests, progress))
    summary = summarize(result["records"], result["duration"], goodput)
    return {"base_url": cfg.base_url, "model": result["model"], "max_concurrency": cfg.max_concurrency,
            "request_rate": cfg.request_rate, "num_prompts": cfg.num_prompts, "seed": cfg.seed, "summary": summary,
            "step_profile": result["step_profile"], "engine": result["engine"],
            "requests": records_as_dicts(result["records"])}


def print_summary(point: dict) -> None:
    s = point["summary"]
    print(f"\n==== {point['base_url']}  model={point['model']}  concurrency={point['max_concurrency']}  "
          f"rate={point['request_rate']} ====")
    print(f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s")
    print(f"input tokens {s['total_input_tokens']}  output tokens {s['total_output_tokens']}")
    print(f"request throughput {s['request_throughput']:.2f} req/s   output {s['output_throughput']:.1f} tok/s   "
          f"total {s['total_token_throughput']:.1f} tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = s[name]
        print(f"{name[:-3].upper():>5} ms  mean {m['mean']:8.1f}  median {m['median']:8.1f}  p90 {m['p90']:8.1f}  "
              f"p99 {m['p99']:8.1f}")
    if "goodput" in s:
        print(f"goodput {s['goodput']['request_goodput']:.2f} req/s ({s['goodput']['requests']} requests "
              f"within {s['goodput']['slo_ms']})")
    if point.get("step_profile"):
        print(profile_table([point], "concurrency"))


def profile_table(points: list[dict], axis: str) -> str:
    """The engine's step profile per point (Harpoon's /metrics; empty for other servers)."""
    lines = [f"| server | {axis} | steps | tokens/step | decodes/step | ms/step | busy | forward | head+sample | "
             "python+scheduling | GEMM GFLOP/s | of peak |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        f = p.get("step_profile")
        if not f:
            continue
        x = p["max_concurrency"] if axis == "concurrency" else p["request_rate"]
        peak = "-"
        if "gemm_peak_gflops" in f:
            peak = f"{100 * f['gemm_share_of_peak']:.0f}% of {f['gemm_peak_gflops']:.0f}"
        lines.append(f"| {_name(p)} | {x} | {f['steps']} | {f['tokens_per_step']:.1f} | {f['decodes_per_step']:.1f} | "
                     f"{f['ms_per_step']:.1f} | {100 * f['busy_share']:.0f}% | {100 * f['share']['forward']:.0f}% | "
                     f"{100 * f['share']['sample']:.0f}% | {100 * f['python_share']:.0f}% | {f['gemm_gflops']:.0f} | "
                     f"{peak} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _name(point: dict) -> str:
    return point.get("label") or point["base_url"]


def markdown_table(points: list[dict], axis: str) -> str:
    lines = [f"| server | {axis} | req/s | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | "
             "TPOT p99 (ms) | ITL p99 (ms) | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        s = p["summary"]
        x = p["max_concurrency"] if axis == "concurrency" else p["request_rate"]
        lines.append(f"| {_name(p)} | {x} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
                     f"{s['ttft_ms']['median']:.0f} | {s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['median']:.1f} | "
                     f"{s['tpot_ms']['p99']:.1f} | {s['itl_ms']['p99']:.0f} | {s['failed']} |")
    return "\n".join(lines)


def ratio_table(points: list[dict], axis: str) -> str:
    """Each other server against the first, point by point: throughput ratio and TTFT/ITL ratios (< 1 is better)."""
    key = "max_concurrency" if axis == "concurrency" else "request_rate"
    names = list(dict.fromkeys(_name(p) for p in points))
    by = {(_name(p), p[key]): p["summary"] for p in points}
    lines = [f"| {axis} | server | vs | out tok/s ratio | TTFT p50 ratio | ITL p99 ratio |",
             "|---|---|---|---|---|---|"]
    for x in dict.fromkeys(p[key] for p in points):
        for name in names[1:]:
            a, b = by.get((names[0], x)), by.get((name, x))
            if a and b:
                lines.append(f"| {x} | {names[0]} | {name} | {a['output_throughput'] / b['output_throughput']:.2f} | "
                             f"{a['ttft_ms']['median'] / b['ttft_ms']['median']:.2f} | "
                             f"{a['itl_ms']['p99'] / b['itl_ms']['p99']:.2f} |")
    return "\n".join(lines)


def best_table(points: list[dict], axis: str, groups: list[str]) -> str:
    """Per point, the fastest server of each group (servers named with the group's prefix, e.g. one per dtype)
    against the fastest of the last group: "best against best"."""
    key = "max_concurrency" if axis == "concurrency" else "request_rate"
    lines = [f"| {axis} | best | out tok/s | TTFT p50 (ms) | vs best | out tok/s | TTFT p50 (ms) | out tok/s ratio | "
             "TTFT p50 ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for x in dict.fromkeys(p[key] for p in points):
        best = []
        for group in groups:
            members = [p for p in points if p[key] == x and _name(p).startswith(group)]
            best.append(max(members, key=lambda p: p["summary"]["output_throughput"]) if members else None)
        if None in best:
            continue
        b = best[-1]["summary"]
        for p in best[:-1]:
            a = p["summary"]
            lines.append(f"| {x} | {_name(p)} | {a['output_throughput']:.1f} | {a['ttft_ms']['median']:.0f} | "
                         f"{_name(best[-1])} | {b['output_throughput']:.1f} | {b['ttft_ms']['median']:.0f} | "
                         f"{a['output_throughput'] / b['output_throughput']:.2f} | "
                         f"{a['ttft_ms']['median'] / b['ttft_ms']['median']:.2f} |")
    return "\n".join(lines)


def plot(points: list[dict], axis: str, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    key = "max_concurrency" if axis == "concurrency" else "request_rate"
    servers = list(dict.fromkeys(_name(p) for p in points))
    charts = {
        "throughput.png": ("output tokens/s", [("output_throughput", None, "")]),
        "ttft.png": ("TTFT (ms)", [("ttft_ms", "median", " p50"), ("ttft_ms", "p99", " p99")]),
        "tpot.png": ("TPOT (ms)", [("tpot_ms", "median", " p50"), ("tpot_ms", "p99", " p99")]),
    }
    written = []
    for filename, (ylabel, series) in charts.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for server in servers:
            mine = [p for p in points if _name(p) == server]
            xs = [p[key] for p in mine]
            for metric, stat, suffix in series:
                ys = [p["summary"][metric] if stat is None else p["summary"][metric][stat] for p in mine]
                ax.plot(xs, ys, marker="o", label=f"{server}{suffix}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(axis)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=BenchConfig.base_url)
    p.add_argument("--endpoint", default=BenchConfig.endpoint, choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", default="random", choices=["random", "chat", "prefix"])
    p.add_argument("--num-prompts", type=int, default=BenchConfig.num_prompts)
    p.add_argument("--input-len", type=int, default=BenchConfig.input_len)
    p.add_argument("--output-len", type=int, default=BenchConfig.output_len)
    p.add_argument("--range-ratio", type=float, default=BenchConfig.range_ratio)
    p.add_argument("--prefix-len", type=int, default=BenchConfig.prefix_len)
    p.add_argument("--num-prefixes", type=int, default=BenchConfig.num_prefixes,
                   help="the prefix dataset's distinct prefixes, one drawn per request")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--temperature", type=float, default=BenchConfig.temperature)
    p.add_argument("--request-timeout", type=float, default=BenchConfig.request_timeout)
    p.add_argument("--tokenizer", default=None, help="tokenizer for building prompts (default: the default model's)")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs such as ttft:500 tpot:50 (milliseconds)")
    p.add_argument("--sweep-concurrency", default=None, help="e.g. 1,4,16,64: one run per point")
    p.add_argument("--sweep-rates", default=None, help="e.g. 1,2,4: one run per request rate")
    p.add_argument("--compare", nargs="*", default=[], help="more base URLs to run the same benchmark against")
    p.add_argument("--label", nargs="*", default=[], help="names for --base-url and the --compare URLs, in order")
    p.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                   help="run nothing: combine files written by --save (one engine at a time) into one table, "
                        "ratios against the first, and plots")
    p.add_argument("--best-of", nargs="*", default=None, metavar="PREFIX",
                   help="with --merge: per point, the fastest server named PREFIX* against the fastest of the last "
                        "prefix (e.g. --best-of harpoon vllm, each run in several dtypes)")
    p.add_argument("--save", default=None, help="write the full results as JSON here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots of a sweep here")
    p.add_argument("--no-progress", action="store_true")
    return p


def merge(files: list[str], plot_dir: str | None, best_of: list[str] | None = None) -> dict:
    runs = [json.loads(Path(f).read_text()) for f in files]
    axis = runs[0]["axis"]
    if not axis or any(r["axis"] != axis for r in runs):
        raise SystemExit("--merge needs sweeps over the same axis")
    points = [p for r in runs for p in r["points"]]
    table, ratios = markdown_table(points, axis), ratio_table(points, axis)
    print(table + "\n\n" + ratios)
    merged = {"axis": axis, "points": points, "table": table, "ratios": ratios, "sources": files}
    if best_of:
        merged["best"] = best_table(points, axis, best_of)
        print("\n" + merged["best"])
    profiles = profile_table(points, axis)
    if profiles:
        merged["step_profiles"] = profiles
        print("\n" + profiles)
    if plot_dir:
        merged["plots"] = [str(p) for p in plot(points, axis, Path(plot_dir))]
    return merged


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.merge is not None:
        return merge(args.merge, args.plot_dir, args.best_of)
    goodput = parse_goodput(args.goodput)
    fields = {f for f in BenchConfig.__dataclass_fields__}
    base = BenchConfig(**{k: v for k, v in vars(args).items() if k in fields})
    tokenizer = load_tokenizer(args.tokenizer)
    if args.sweep_concurrency:
        axis, values = "concurrency", [int(v) for v in args.sweep_concurrency.split(",")]
    elif args.sweep_rates:
        axis, values = "rate", [float(v) for v in args.sweep_rates.split(",")]
    else:
        axis, values = None, [None]
    points = []
    urls = [args.base_url, *args.compare]
    labels = dict(zip(urls, args.label, strict=False))
    for url in urls:
        for index, value in enumerate(values):
            # Fresh prompts per point (the same for every server): an earlier point's prompts would otherwise be
            # prefix-cache hits for a server that keeps them, and its TTFT would not measure prefill.
            cfg = replace(base, base_url=url, seed=base.seed + index)
            if axis == "concurrency":
                cfg = replace(cfg, max_concurrency=value, num_prompts=max(base.num_prompts, 2 * value))
            elif axis == "rate":
                cfg = replace(cfg, request_rate=value)
            point = benchmark_point(cfg, tokenizer, goodput, progress=not args.no_progress)
            if url in labels:
                point["label"] = labels[url]
            print_summary(point)
            points.append(point)
    results = {"config": {k: (str(v) if isinstance(v, float) and np.isinf(v) else v) for k, v in asdict(base).items()},
               "servers": [args.base_url, *args.compare], "git_commit": _git_commit(), "machine": machine(),
               "axis": axis, "points": points}
    if axis:
        table = markdown_table(points, axis)
        results["table"] = table
        print("\n" + table)
        profiles = profile_table(points, axis)
        if profiles:
            results["step_profiles"] = profiles
            print("\n" + profiles)
        if len(urls) > 1:
            results["ratios"] = ratio_table(points, axis)
            print("\n" + results["ratios"])
        if args.plot_dir:
            results["plots"] = [str(p) for p in plot(points, axis, Path(args.plot_dir))]
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
