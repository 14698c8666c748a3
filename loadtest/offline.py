"""Offline benchmark of the engine in-process, no HTTP.

1. Throughput, nano-vllm's method: N requests with random token ids and random input/output lengths, ``ignore_eos``,
   all submitted at once; output tokens per second.
2. The new-token sweep: one prompt, ``max_tokens`` in 32/128/512/1024, greedy, for Harpoon and for transformers'
   ``generate`` with and without its KV cache, printing ``| new_tokens | tok/s | ms/tok | TTFT (ms) | peak MB |``.
   ms/tok is the time per output token after the first (TPOT); peak MB is the process's peak RSS during the run.
   With ``--rounds N`` Harpoon runs the points round-robin N times and reports each point's median run: this
   machine kind drifts by 5-25% over minutes, enough to decide a ratio between two single runs.

    python -m loadtest.offline                       # both parts, default model
    python -m loadtest.offline --part sweep --sweep 32,128 --no-hf
    python -m loadtest.offline --part sweep --sweep 32,1024 --no-hf --rounds 5
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import time
from dataclasses import asdict, dataclass

import torch

from engine import LLM, SamplingParams
from loadtest.memory import PeakRSS

SWEEP_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class SweepRow:
    engine: str
    new_tokens: int
    tok_s: float
    ms_per_token: float
    ttft_ms: float
    peak_mb: float


def throughput(llm: LLM, num_seqs: int, min_len: int, max_input_len: int, max_output_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_input_len))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(min_len, max_output_len))
        for _ in range(num_seqs)
    ]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    return {
        "num_seqs": num_seqs,
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": num_out,
        "seconds": elapsed,
        "output_tok_s": num_out / elapsed,
        "preemptions": stats.num_preemptions,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
    }


def harpoon_sweep_point(llm: LLM, prompt_ids: list[int], new_tokens: int) -> SweepRow:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    with PeakRSS() as peak:
        start = time.perf_counter()
        engine.add_request(f"sweep-{new_tokens}", prompt_ids, params)
        first = None
        count = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                count += len(out.new_token_ids)
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
    assert count == new_tokens
    return _row("harpoon", new_tokens, start, first, end, peak.mb)


def harpoon_sweep(llm: LLM, prompt_ids: list[int], points: list[int], rounds: int) -> list[SweepRow]:
    """Each point ``rounds`` times, round-robin, so drift lands on every point alike; per point the run of median
    ms/token (the lower middle one for an even count)."""
    runs: dict[int, list[SweepRow]] = {n: [] for n in points}
    for _ in range(rounds):
        for n in points:
            runs[n].append(harpoon_sweep_point(llm, prompt_ids, n))
    return [sorted(rows, key=lambda r: r.ms_per_token)[(rounds - 1) // 2] for rows in runs.values()]


def hf_sweep_point(model, prompt_ids: list[int], new_tokens: int, use_cache: bool) -> SweepRow:
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value: torch.Tensor) -> None:
            self.calls += 1
            if self.calls == 2:  # the first call carries the prompt
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    streamer = FirstToken()
    ids = torch.tensor([prompt_ids])
    with PeakRSS() as peak, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
            streamer=streamer,
            pad_token_id=model.generation_config.eos_token_id,
        )
        end = time.perf_counter()
    assert out.shape[1] - len(prompt_ids) == new_tokens
    name = "transformers (KV cache)" if use_cache else "transformers (no cache)"
    return _row(name, new_tokens, start, streamer.first, end, peak.mb)


def _row(name: str, n: int, start: float, first: float, end: float, peak_mb: float) -> SweepRow:
    return SweepRow(name, n, n / (end - start), 1000 * (end - first) / max(1, n - 1), 1000 * (first - start), peak_mb)


def print_sweep(rows: list[SweepRow]) -> None:
    for name in dict.fromkeys(r.engine for r in rows):
        print(f"\n{name}\n\n| new_tokens | tok/s | ms/tok | TTFT (ms) | peak MB |\n|---|---|---|---|---|")
        for r in rows:
            if r.engine == name:
                print(f"| {r.new_tokens} | {r.tok_s:.1f} | {r.ms_per_token:.1f} | {r.ttft_ms:.0f} | {r.peak_mb:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model path, .gguf or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--part", choices=["all", "throughput", "sweep"], default="all")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--sweep", default="32,128,512,1024", help="comma-separated new-token counts")
    parser.add_argument("--rounds", type=int, default=1, help="Harpoon's sweep points run round-robin this often")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers rows of the sweep")
    parser.add_argument(
        "--hf-no-cache-max",
        type=int,
        default=1024,
        help="largest new-token count for transformers without KV cache (it is quadratic)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the results as JSON to this file")
    args, engine_flags = parser.parse_known_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_args = _parse_engine_flags(engine_flags)

    llm = LLM(args.model, **engine_args)
    results: dict = {
        "model": llm.engine.model_name,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "engine_args": engine_args,
    }
    if args.part in ("all", "throughput"):
        tp = throughput(llm, args.num_seqs, args.min_len, args.max_input_len, args.max_output_len, args.seed)
        results["throughput"] = tp
        print(
            f"\nthroughput: {tp['num_seqs']} requests, {tp['input_tokens']} input / {tp['output_tokens']} output "
            f"tokens in {tp['seconds']:.1f} s = {tp['output_tok_s']:.1f} output tok/s "
            f"({tp['preemptions']} preemptions; prefix cache: {tp['prefix_cache_hits']} of "
            f"{tp['prefix_cache_queries']} prompt tokens hit)"
        )
    if args.part in ("all", "sweep"):
        prompt_ids = llm.tokenizer.encode(SWEEP_PROMPT)
        points = [int(n) for n in args.sweep.split(",")]
        harpoon_sweep_point(llm, prompt_ids, 8)  # warm-up
        rows = harpoon_sweep(llm, prompt_ids, points, args.rounds)
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            from engine.model_loader import reference_folder

            hf = AutoModelForCausalLM.from_pretrained(reference_folder(args.model), dtype=torch.float32).eval()
            hf_sweep_point(hf, prompt_ids, 8, True)  # warm-up
            rows += [hf_sweep_point(hf, prompt_ids, n, True) for n in points]
            rows += [hf_sweep_point(hf, prompt_ids, n, False) for n in points if n <= args.hf_no_cache_max]
        results["sweep"] = [asdict(r) for r in rows]
        print_sweep(rows)
        first, last = rows[0], rows[len(points) - 1]
        growth = last.ms_per_token / first.ms_per_token - 1
        runs = f"the median of {args.rounds} runs taken round-robin" if args.rounds > 1 else "one run"
        print(f"\nharpoon: ms/token at {last.new_tokens} new tokens is {growth:+.1%} against {first.new_tokens} "
              f"(per point, {runs})")
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f, indent=2)


def _parse_engine_flags(flags: list[str]) -> dict:
    """``--max-num-seqs 64`` style engine options, passed through to ``LLM``."""
    from engine.arg_utils import parse_engine_args

    return parse_engine_args(flags)


if __name__ == "__main__":
    main()
