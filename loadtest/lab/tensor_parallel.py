"""What tensor parallelism costs and buys on this machine, in-process: the same batches of random prompts through an
engine at each ``--tensor-parallel-size``, one size after the other. Per size and batch: output tok/s, the mean step,
and the all-reduces' share of the forward (their count a step and time a call, waiting for the slowest rank
included), as rank 0 sees them; and which way the ranks sum (shared memory or gloo, timed at start).

    python -m loadtest.lab.tensor_parallel --sizes 1,2 --batches 1,16,64
    python -m loadtest.lab.tensor_parallel --model ~/.cache/harpoon/random-models/llama-3.2-1b-q8_0.gguf --sizes 1,2
"""

from __future__ import annotations

import argparse
import json
import time

from engine import LLM, SamplingParams
from loadtest.datasets import build_requests


def run_size(model: str | None, size: int, batches: list[int], input_len: int, output_len: int,
             engine_args: dict) -> list[dict]:
    llm = LLM(model, tensor_parallel_size=size, **engine_args)
    engine, rows = llm.engine, []
    sums = engine.tp_workers.all_reduce if engine.tp_workers is not None else None
    if sums is not None:
        print(sums.describe())
    try:
        for batch in batches:
            requests = build_requests("random", llm.tokenizer, batch, input_len, output_len, 0.0, 0, seed=batch)
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            llm.generate([r.prompt for r in requests[:1]], SamplingParams(max_tokens=2))  # warm this batch's path
            steps, forward = engine.counters.num_steps, engine.counters.forward_s
            sum_s, calls = (sums.seconds, sums.num_calls) if sums else (0.0, 0)
            start = time.perf_counter()
            outputs = llm.generate([r.prompt for r in requests], params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            steps, forward = engine.counters.num_steps - steps, engine.counters.forward_s - forward
            sum_s, calls = ((sums.seconds - sum_s, sums.num_calls - calls) if sums else (0.0, 0))
            rows.append({"tp": size, "batch": batch, "out_tok_s": tokens / elapsed, "step_ms": 1e3 * elapsed / steps,
                         "forward_ms": 1e3 * forward / steps, "sum_share": sum_s / forward if forward else 0.0,
                         "sums_per_step": calls / steps, "us_per_sum": 1e6 * sum_s / calls if calls else 0.0,
                         "way": sums.way if sums else None})
    finally:
        engine.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    from engine.arg_utils import parse_memory

    engine_args = {"kv_cache_memory": parse_memory(args.kv_cache_memory)}
    batches = [int(b) for b in args.batches.split(",")]
    rows = [row for size in (int(s) for s in args.sizes.split(",")) for row in
            run_size(args.model, size, batches, args.input_len, args.output_len, engine_args)]
    print(f"{args.input_len} in / {args.output_len} out, random prompts, the whole batch at once; "
          "sums: rank 0's time in them, waiting included")
    print("| TP | batch | out tok/s | step (ms) | forward (ms) | sums a step | us a sum | sums' share of forward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['batch']} | {r['out_tok_s']:.1f} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} | "
              f"{r['sums_per_step']:.0f} | {r['us_per_sum']:.0f} | {100 * r['sum_share']:.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
