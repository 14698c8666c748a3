"""The exact Q8 LM head's int8 screen (``Int8ScreenedHead``) against the exact head, in one engine: greedy
generation of fresh random prompts with the screen and without it, alternating run by run, then how many
candidates each row of the hidden states met left to recompute. The default model's head is its Q8_0 table.

    python -m loadtest.lab.int8_screen --batches 1,16,64 --rounds 3

The screen serves only the batch sizes start-up timed it faster for (logged, and printed here); elsewhere both
columns run the exact head.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.backends.greedy_head import Int8ScreenedHead
from kernels import cpu as cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    llm = LLM(args.model)
    backend = llm.engine.backend
    screen = backend.greedy_head
    if not isinstance(screen, Int8ScreenedHead):
        raise SystemExit(f"no int8 screen here (greedy head: {type(screen).__name__}): a Q8 head, exact products "
                         "and integer dot products are needed, and start-up must have timed it faster")
    print(f"screen at {screen.min_rows}-{screen.max_rows} rows; out tok/s, fresh {args.prompt_len}-token prompts, "
          f"{args.output_len} greedy tokens each")
    print("| prompts at once | with the screen | exact head |\n|---|---|---|")
    rng, vocab = random.Random(0), llm.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    hidden = []
    backend_argmax = screen.argmax
    for n in map(int, args.batches.split(",")):
        rates: dict[str, list[float]] = {"screen": [], "exact": []}
        for r in range(args.rounds):
            for name in ("screen", "exact") if r % 2 == 0 else ("exact", "screen"):
                backend.greedy_head = screen if name == "screen" else None
                prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(n)]
                start = time.perf_counter()
                llm.generate(prompts, params)
                rates[name].append(n * args.output_len / (time.perf_counter() - start))
        print(f"| {n} | {', '.join(f'{v:.1f}' for v in rates['screen'])} | "
              f"{', '.join(f'{v:.1f}' for v in rates['exact'])} |")
    backend.greedy_head = screen
    screen.argmax = lambda h: hidden.append(h.clone()) or backend_argmax(h)
    llm.generate([[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(16)], params)
    rows = torch.cat(hidden)
    approx = cpu_kernels.linear(rows, screen.packed, screen.vocab_size, int8_activations=True).double()
    exact = cpu_kernels.linear(rows, screen.packed, screen.vocab_size).double()
    radius = screen.row_scale(rows)[:, None] * screen.error[None, :]
    counts = (approx + radius >= (approx - radius).amax(1, keepdim=True)).sum(1).tolist()
    print(f"\ncandidates per row over {len(counts)} rows: median {statistics.median(counts)}, "
          f"p90 {sorted(counts)[int(0.9 * len(counts))]}, max {max(counts)}; largest |approx - exact| / bound "
          f"{((approx - exact).abs() / radius).max().item():.3f}")


if __name__ == "__main__":
    main()
