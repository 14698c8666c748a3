"""Data parallel on one host: N ``harpoon serve`` replicas behind a router, and what prefix-aware routing buys.

    python -m loadtest.replicas --replicas 2 --policies cache_aware,round_robin --save results/replicas.json

For each routing policy, from a clean start: N replicas (each pinned to its share of the cores), sglang-router in
front of them with that policy (``pip install 'harpoon[router]'``), then the prefix workload of ``loadtest.serve``
through the router: many requests, each under one of ``--num-prefixes`` long shared prefixes (the system prompts
of different apps, documents under questions). Each replica's ``/metrics`` is read before and after, so the table
gives the prefix-cache hit rate the replicas saw, the requests each one served, and the client's TTFT and
throughput. A router that sends a prefix to the replica that has it cached keeps each replica's working set to its
share of the prefixes; round robin makes every replica hold all of them, and a KV pool smaller than that evicts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp

from loadtest.processes import start, stop, wait_healthy
from loadtest.serve import BenchConfig, benchmark_point, engine_metrics, load_tokenizer, machine, served_model

ROUTER_PORT = 8300
FIRST_REPLICA_PORT = 8301


def model_of(url: str) -> str:
    async def ask() -> str:
        async with aiohttp.ClientSession() as http:
            return await served_model(http, url)

    return asyncio.run(ask())


def read_metrics(urls: list[str]) -> list[dict]:
    async def read() -> list[dict]:
        async with aiohttp.ClientSession() as http:
            return [await engine_metrics(http, url) or {} for url in urls]

    return asyncio.run(read())


def run_policy(policy: str, args: argparse.Namespace, cfg: BenchConfig, tokenizer, out: Path) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // args.replicas)
    urls = [f"http://127.0.0.1:{FIRST_REPLICA_PORT + i}" for i in range(args.replicas)]
    procs = []
    try:
        for i, url in enumerate(urls):
            mine = cores[(i * share) % len(cores):][:share]
            log = out / f"{policy}-replica{i}.log"
            procs.append(start([sys.executable, "-m", "server", "--port", url.rsplit(":", 1)[1], "--num-threads",
                                str(len(mine)), "--log-level", "warning", *args.serve_args.split()], log, mine))
        for url, proc, i in zip(urls, procs, range(len(urls)), strict=True):
            wait_healthy(url, proc, out / f"{policy}-replica{i}.log")
        router_log = out / f"{policy}-router.log"
        router = start([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                        str(ROUTER_PORT), "--worker-urls", *urls, "--policy", policy,
                        "--health-check-interval-secs", "5"], router_log)
        procs.append(router)
        wait_healthy(f"http://127.0.0.1:{ROUTER_PORT}", router, router_log)
        if cfg.model is None:  # the router's /v1/models names no model; a replica's does
            cfg = replace(cfg, model=model_of(urls[0]))
        before = read_metrics(urls)
        point = benchmark_point(cfg, tokenizer, None, progress=False)
        after = read_metrics(urls)
    finally:
        stop(procs)
    def grew(key: str) -> list[float]:
        return [a.get(key, 0.0) - b.get(key, 0.0) for b, a in zip(before, after, strict=True)]

    served = [int(n) for n in grew("e2e_request_latency_seconds_count")]
    queries, hits = sum(grew("prefix_cache_queries_total")), sum(grew("prefix_cache_hits_total"))
    s = point["summary"]
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "served": served,
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "out_tok_s": s["output_throughput"], "failed": s["failed"], "point": point}


def table(rows: list[dict]) -> str:
    lines = ["| policy | prefix-cache hit rate | requests per replica | TTFT p50 (ms) | TTFT p99 (ms) | out tok/s "
             "| failed |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {100 * r['hit_rate']:.1f}% | {' / '.join(map(str, r['served']))} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['out_tok_s']:.1f} | {r['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="cache_aware,round_robin", help="sglang-router policies, comma-separated")
    p.add_argument("--serve-args", default="--kv-cache-memory 300MiB", help="flags for every replica")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=32, help="each request's own suffix, after its prefix")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="the model name to send (default: the first replica's /v1/models)")
    p.add_argument("--out", default="results/replicas", help="folder for the processes' logs")
    p.add_argument("--save", help="write the rows and every point as JSON here")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig(base_url=f"http://127.0.0.1:{ROUTER_PORT}", dataset="prefix", num_prompts=args.num_prompts,
                      input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
                      num_prefixes=args.num_prefixes, max_concurrency=args.concurrency, seed=args.seed,
                      model=args.model, num_warmups=0)
    tokenizer = load_tokenizer(None)
    rows = []
    for policy in args.policies.split(","):
        rows.append(run_policy(policy, args, replace(cfg), tokenizer, out))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{args.replicas} replicas, {args.concurrency} clients, {args.num_prompts} requests under "
          f"{args.num_prefixes} prefixes of {args.prefix_len} tokens (+{args.input_len} own, {args.output_len} out)\n")
    print(table(rows))
    if args.save:
        Path(args.save).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
