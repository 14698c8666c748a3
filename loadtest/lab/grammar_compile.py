"""What compiling a new grammar costs the streams already running: the engine in-process, a batch of plain requests
decoding, and a request whose JSON schema was never seen before joining at a fixed step. The compile runs either
inside the step loop ("inline": the request waits for it in ``add_request``, as the engine did before its compile
thread) or beside it ("thread": the engine's way), the two alternating round by round, each round with a fresh
schema so that xgrammar's cache never answers.

    python -m loadtest.lab.grammar_compile                         # 16 plain streams, an optional bounded string
    python -m loadtest.lab.grammar_compile --batch 1,16 --rounds 5

Per variant, medians over the rounds: the plain streams' step-to-step gap before the join and the longest one after
it (a stream's worst inter-token latency), the median gap while the compile ran, and the grammar request's time
from its arrival to its first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.engine_core import EngineCore


def fresh_schema(round_index: int) -> str:
    """A schema that xgrammar takes ~0.8-1.2 s to compile for SmolLM2's 49k tokens: an optional string with a
    maxLength of hundreds (its repetitions of the character rule become states whose token masks are precomputed).
    The bound differs by a hundred each round: near bounds share most of their work in xgrammar's caches."""
    return json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 100 * round_index}}})


def one_round(engine: EngineCore, prompts: list[list[int]], schema: str, join_step: int, inline: bool,
              max_tokens: int) -> dict[str, float]:
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"plain-{i}", ids, plain)
    grammar = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=schema))
    before, during, after = [], [], []
    joined = first_token = None
    last = time.perf_counter()
    step = 0
    while engine.has_unfinished_requests():
        if step == join_step:
            joined = time.perf_counter()
            if inline:
                engine.grammars.compile(grammar.structured_outputs)  # the engine's own compile then hits the cache
            engine.add_request("grammar", prompts[0], grammar)
        outputs = engine.step()
        now = time.perf_counter()
        if 1 < step < join_step:  # the first steps prefill the batch
            before.append(now - last)
        elif step >= join_step and any(o.request_id.startswith("plain") for o in outputs):
            after.append(now - last)
            if first_token is None:
                during.append(now - last)
        if first_token is None and any(o.request_id == "grammar" and o.new_token_ids for o in outputs):
            first_token = now - joined
        last = now
        step += 1
    return {"gap before (ms)": statistics.median(before) * 1e3,
            "gap during (ms)": statistics.median(during) * 1e3 if during else float("nan"),
            "longest gap after (ms)": max(after) * 1e3,
            "grammar TTFT (ms)": first_token * 1e3}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder, .gguf or hub id (default: the bundled SmolLM2)")
    p.add_argument("--batch", default="16", help="plain requests decoding when the grammar request joins")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--join-step", type=int, default=8, help="the step the grammar request joins at (>= 3)")
    p.add_argument("--max-tokens", type=int, default=96, help="each plain request's output")
    args = p.parse_args(argv)
    llm = LLM(args.model)
    engine = llm.engine
    engine.grammars.compile(StructuredOutputsParams(json_object=True))  # the tokenizer's tables, built once
    print("| batch | compile | gap before (ms) | gap during (ms) | longest gap after (ms) | grammar TTFT (ms) |")
    print("|---|---|---|---|---|---|")
    round_index = 0
    for batch in [int(b) for b in args.batch.split(",")]:
        # NOTE: ids wrap around a test model's smaller vocabulary (a no-op for a real one)
        prompts = [[t % engine.vocab_size for t in llm.tokenizer.encode(f"Request {i} tells a story about")]
                   for i in range(batch)]
        results: dict[str, list[dict[str, float]]] = {"inline": [], "thread": []}
        for _ in range(args.rounds):
            for name in results:
                round_index += 1
                results[name].append(one_round(engine, prompts, fresh_schema(round_index), args.join_step,
                                               name == "inline", args.max_tokens))
        for name, rounds in results.items():
            cells = [statistics.median(r[k] for r in rounds) for k in rounds[0]]
            print(f"| {batch} | {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
