"""How long the first bursts of new prompts take after start-up, against the same bursts again.

A burst too big for a CUDA graph runs eagerly, and the first eager step of its kind can pay for compiling Triton
kernels and loading GEMM kernels; the engine's start-up warm-up (``EngineCore._warm_up``) is meant to pay that
before the first user. Each burst is ``--prompt-len``-token random prompts served to ``--max-tokens`` new tokens
through ``LLM.generate``, timed end to end; the Triton cache's entry count shows where a compile happened.

    TRITON_CACHE_DIR=$(mktemp -d) python -m loadtest.lab.first_bursts --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams


def triton_cache_entries() -> int:
    folder = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return len(list(folder.iterdir())) if folder.is_dir() else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--bursts", default="1,1,16,16,64,64,16,37,37,200,200", help="prompts per burst, in order")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=2)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    print(f"start-up {time.perf_counter() - started:.1f} s (warm-up included), Triton cache entries "
          f"{triton_cache_entries()}")
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    print("| prompts | ms | Triton cache entries |\n|---|---|---|")
    for n in (int(b) for b in args.bursts.split(",")):
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(n)]
        sync()
        t = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        print(f"| {n} | {(time.perf_counter() - t) * 1000:.1f} | {triton_cache_entries()} |", flush=True)


if __name__ == "__main__":
    main()
