"""What n-gram speculative decoding buys one stream, in-process: the same greedy requests through two engines, one
with ``speculative_config`` and one without, alternating request by request (so the machine's drift lands on both).

Two workloads: ``random`` (the serving benchmark's random-token prompts, ``ignore_eos``, whose outputs tend to loop)
and ``chat`` (instructions over this repository's own text and code, chat template, stopping at EOS). Prints output
tok/s both ways, the speed-up, and the share of drafts accepted; the tokens must be identical both ways.

    python -m loadtest.lab.spec_decode
    python -m loadtest.lab.spec_decode --speculative-config '{"num_speculative_tokens": 3}' --workloads chat
    python -m loadtest.lab.spec_decode --workloads random --num-prompts 16 --batch   # 16 requests at once
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine import LLM, SamplingParams
from loadtest.datasets import build_requests

ROOT = Path(__file__).resolve().parent.parent
CHAT_ASKS = [
    ("Summarize this text in five bullet points:\n\n", ROOT / "docs" / "architecture.md", 0, 1500),
    ("Explain what this Python code does, step by step:\n\n", ROOT / "engine" / "block_manager.py", 3000, 1500),
    ("Add type hints and docstrings to this code and print it back in full:\n\n", ROOT / "engine" / "scheduler.py",
     6000, 1500),
    ("Write a short story about a lighthouse keeper who finds a message in a bottle.", None, 0, 0),
    ("List the 20 largest countries by area with their capitals.", None, 0, 0),
    ("What is the difference between a process and a thread? Answer in detail.", None, 0, 0),
]


def workload(name: str, llm: LLM, num: int, max_tokens: int) -> tuple[list[str], SamplingParams]:
    if name == "random":
        requests = build_requests("random", llm.tokenizer, num, 128, max_tokens, 0.0, 0, seed=7)
        return [r.prompt for r in requests], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = []
    for ask, path, start, length in CHAT_ASKS[:num]:
        text = ask + (path.read_text()[start : start + length] if path else "")
        messages = [{"role": "user", "content": text}]
        prompts.append(llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return prompts, SamplingParams(temperature=0, max_tokens=max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--speculative-config", default="{}", help="JSON, as harpoon serve takes it")
    parser.add_argument("--workloads", default="random,chat")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", action="store_true", help="submit each workload's prompts at once, not one by one")
    args = parser.parse_args()

    engines = {"plain": LLM(args.model), "ngram": LLM(args.model, speculative_config=args.speculative_config)}
    print(f"speculative_config: {engines['ngram'].engine.config.speculative_config}\n")
    print("| workload | prompts | output tokens | plain tok/s | ngram tok/s | speed-up | drafts accepted |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        prompts, params = workload(name, engines["plain"], args.num_prompts, args.max_tokens)
        seconds, tokens = {"plain": 0.0, "ngram": 0.0}, {"plain": [], "ngram": []}
        stats_before = engines["ngram"].engine.stats()
        for group in [prompts] if args.batch else [[p] for p in prompts]:
            for label, llm in engines.items():
                start = time.perf_counter()
                outs = llm.generate(group, params)
                seconds[label] += time.perf_counter() - start
                tokens[label] += [o.outputs[0].token_ids for o in outs]
        if tokens["plain"] != tokens["ngram"]:
            raise SystemExit(f"{name}: the tokens differ with speculation")
        stats = engines["ngram"].engine.stats()
        drafts = stats.spec_draft_tokens - stats_before.spec_draft_tokens
        accepted = stats.spec_accepted_tokens - stats_before.spec_accepted_tokens
        num = sum(len(t) for t in tokens["plain"])
        plain, ngram = num / seconds["plain"], num / seconds["ngram"]
        print(f"| {name} | {len(prompts)} | {num} | {plain:.1f} | {ngram:.1f} | {ngram / plain:.2f}x | "
              f"{accepted} of {drafts} ({accepted / max(drafts, 1):.0%}) |")


if __name__ == "__main__":
    main()
