"""The engine's own Python per step, with a model too small to matter: what a GPU's step pays on the host.

On the H200 the default model's step at 256 clients was 52-61% "python + scheduling"
(docs/history/benchmarks-2026-12.md): the scheduler, the runner's inputs, the sampling settings and the update, per
request per step. Here the same engine runs a 2-layer, 64-wide random Llama on the CPU, so that those phases, not the
matmuls, fill the step, and a change to them can be timed on any machine. Each round admits ``--requests`` prompts of
``--prompt-len`` random ids and runs them greedily to ``--max-tokens`` tokens; it prints ms a step and each phase's ms a
step.

    python -m loadtest.lab.host_overhead --requests 256 --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import STEP_PHASES
from engine.sampling_params import SamplingParams

VOCAB = 512


def tiny_llama(folder: Path) -> Path:
    """A random Llama of 2 layers, 64 wide, with the default model's tokenizer (the engine loads one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.model_loader import load_tokenizer, resolve_model

    config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    return folder


def one_round(engine: EngineCore, args: argparse.Namespace, rng: random.Random) -> tuple[float, dict[str, float]]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"{time.monotonic_ns()}-{i}", [rng.randrange(3, VOCAB) for _ in range(args.prompt_len)],
                           params)
    before = {p: getattr(engine.counters, f"{p}_s") for p in STEP_PHASES}
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    ms = 1000 * (time.perf_counter() - start) / steps
    return ms, {p: 1000 * (getattr(engine.counters, f"{p}_s") - before[p]) / steps for p in STEP_PHASES}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        engine = EngineCore(EngineConfig(model=str(tiny_llama(Path(folder))), max_num_seqs=args.requests,
                                         kv_cache_memory=256 << 20, max_num_batched_tokens=8192))
        rng = random.Random(0)
        one_round(engine, args, rng)  # warm-up
        rounds = [one_round(engine, args, rng) for _ in range(args.rounds)]
    print(f"{args.requests} requests, {args.prompt_len} in / {args.max_tokens} out, {args.rounds} rounds (median)")
    print("| ms a step | " + " | ".join(STEP_PHASES) + " |")
    print("|---" * (len(STEP_PHASES) + 1) + "|")
    print(f"| {statistics.median(ms for ms, _ in rounds):.2f} | "
          + " | ".join(f"{statistics.median(p[phase] for _, p in rounds):.3f}" for phase in STEP_PHASES) + " |")


if __name__ == "__main__":
    main()
