"""What structured outputs cost a step: the engine in-process, batches of chat prompts decoded plainly or under a
JSON schema, the two alternating round by round (this machine kind drifts by tens of percent within minutes), and
the grammar's own parts: compiling a schema, filling a row's mask, applying the masks of a batch.

    python -m loadtest.lab.structured_output                       # batches of 1, 16 and 64, greedy
    python -m loadtest.lab.structured_output --batch 16 --temperature 0.8 --rounds 5

A step is counted once every row of the batch is decoding; "ms/step" is the median of those steps. The two
workloads' outputs differ in length, so their contexts differ too: "context" is the mean over the counted steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.structured_output import apply_bitmask, new_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                   "facts": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "country", "facts"],
}


def decode_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list[float]]:
    """Seconds of each step in which every request decodes, and the mean context of each."""
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", ids, params)
    times, contexts = [], []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        running = engine.scheduler.running
        if len(running) == len(prompts) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
            times.append(elapsed)
            contexts.append(sum(r.num_tokens for r in running) / len(running))
    return times, contexts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder, .gguf or hub id (default: the bundled SmolLM2)")
    p.add_argument("--batch", default="1,16,64", help="requests decoding together")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    llm = LLM(args.model)
    tok = llm.tokenizer
    grammar = StructuredOutputsParams(json=SCHEMA)
    llm.engine.grammars.compile(grammar)  # cached from here: the batch's requests are ready in the same step

    print("| batch | workload | ms/step | steps | context |")
    print("|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch.split(",")]:
        texts = [tok.apply_chat_template([{"role": "user", "content": f"Describe city number {i} as JSON."}],
                                         add_generation_prompt=True, tokenize=False) for i in range(batch)]
        # NOTE: ids wrap around a test model's smaller vocabulary (a no-op for a real one)
        prompts = [[t % llm.engine.vocab_size for t in tok.encode(text, add_special_tokens=False)] for text in texts]
        runs: dict[str, tuple[list[float], list[float]]] = {"plain": ([], []), "json_schema": ([], [])}
        for r in range(args.rounds):
            for name, structured in (("plain", None), ("json_schema", grammar)):
                params = SamplingParams(temperature=args.temperature, seed=r, max_tokens=args.max_tokens,
                                        structured_outputs=structured)
                times, contexts = decode_steps(llm, prompts, params)
                runs[name][0].extend(times)
                runs[name][1].extend(contexts)
        for name, (times, contexts) in runs.items():
            if times:
                print(f"| {batch} | {name} | {statistics.median(times) * 1e3:.2f} | {len(times)} | "
                      f"{statistics.mean(contexts):.0f} |")

    engine = llm.engine
    started = time.perf_counter()
    engine.grammars.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        f"field_{i}": {"type": "string"} for i in range(30)}}))
    print(f"\ncompile a fresh 30-property schema: {(time.perf_counter() - started) * 1e3:.1f} ms")
    state = engine.grammars.grammar(grammar)
    for t in tok.encode('{"name": "Paris", "country": "France", "facts": ["It is', add_special_tokens=False):
        state.accept(t)
    mask = new_bitmask(1, engine.vocab_size)
    started = time.perf_counter()
    for _ in range(200):
        state.fill_bitmask(mask, 0)
    print(f"fill one row's mask (inside a JSON string): {(time.perf_counter() - started) / 200 * 1e6:.1f} us")
    for rows in (1, 16, 64):
        logits = torch.randn(rows, engine.vocab_size)
        masks = mask.repeat(rows, 1)
        started = time.perf_counter()
        for _ in range(50):
            apply_bitmask(logits, torch.arange(rows), masks)
        print(f"apply {rows} rows' masks: {(time.perf_counter() - started) / 50 * 1e6:.0f} us")


if __name__ == "__main__":
    main()
