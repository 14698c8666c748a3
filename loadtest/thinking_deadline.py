"""Does ``thinking_deadline_ms`` close the thinking in time, under load? Starts a server whose chat template opens
the thinking (DeepSeek-R1's way) with ``--reasoning-parser deepseek_r1``, then streams chats at 1, 4 and 16 clients,
each asking for its thinking to end within the deadline, and never letting the model end it first (``min_tokens``
bans the end of the sequence, and ``max_tokens`` outlasts the deadline). A request keeps its deadline when its
answer's first text reached the client by then (one token after the close: stricter than the close itself) and the
answer goes on to say something (more than whitespace); the client then leaves, which aborts the rest.

    python -m loadtest.thinking_deadline --deadline-ms 2000 [--model M] [--out results.json]

Prints a table: per client count, requests, kept (%), the time to the answer (p50, p95, max) and the thinking
tokens spent (mean), which shrink with load as the engine's step time grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from loadtest.processes import start, stop, wait_healthy
from loadtest.serve import machine

TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}")
QUESTIONS = ["Why is the sky blue?", "Plan a three-day trip to Rome.", "Explain how a heat pump works.",
             "What makes a good password?", "Compare Python and Rust for a web server.",
             "How do vaccines train the immune system?", "Write a haiku about autumn, then explain it.",
             "Why do cats purr?"]


async def one_request(http: aiohttp.ClientSession, url: str, question: str, deadline_ms: float,
                      max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "stream": True, "temperature": 0.7,
            "max_tokens": max_tokens, "min_tokens": max_tokens - 8, "thinking_deadline_ms": deadline_ms,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    answer_at = None
    reasoning, content = "", ""
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                delta = choice["delta"]
                reasoning += delta.get("reasoning_content") or ""
                if delta.get("content") and answer_at is None:
                    answer_at = time.monotonic()
                content += delta.get("content") or ""
            if content.strip():
                break  # the answer says something: leaving aborts the request
    to_answer = (answer_at - sent) * 1000 if answer_at is not None else float("inf")
    return {"to_answer_ms": to_answer, "kept": to_answer <= deadline_ms and bool(content.strip()),
            "reasoning_chars": len(reasoning), "reasoning": reasoning}


async def level(url: str, clients: int, num_requests: int, deadline_ms: float, max_tokens: int,
                tokenizer: object) -> dict:
    results: list[dict] = []
    queue = list(range(num_requests))

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            results.append(await one_request(http, url, QUESTIONS[i % len(QUESTIONS)], deadline_ms, max_tokens))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    times = sorted(r["to_answer_ms"] for r in results)
    tokens = [len(tokenizer.encode(r["reasoning"], add_special_tokens=False)) for r in results]
    return {"clients": clients, "requests": len(results), "kept": sum(r["kept"] for r in results) / len(results),
            "p50_ms": times[len(times) // 2], "p95_ms": times[min(len(times) - 1, int(0.95 * len(times)))],
            "max_ms": times[-1], "thinking_tokens_mean": statistics.mean(tokens)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--deadline-ms", type=float, default=2000.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    log = Path("/tmp/harpoon-thinking-deadline.log")
    command = [sys.executable, "-m", "server", "--port", str(args.port), "--reasoning-parser", "deepseek_r1",
               "--chat-template", TEMPLATE, "--max-num-seqs", str(max(args.clients))]
    if args.model:
        command += ["--model", args.model]
    proc = start(command, log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc, log)
        from engine.model_loader import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(args.model))
        rows = [asyncio.run(level(url, c, max(24, c * args.requests_per_client), args.deadline_ms, args.max_tokens,
                                  tokenizer)) for c in args.clients]
    finally:
        stop([proc])
    print(f"thinking_deadline_ms {args.deadline_ms:.0f}, {machine()}")
    print("| clients | requests | kept | to answer p50 / p95 / max (ms) | thinking tokens (mean) |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {100 * r['kept']:.1f}% | {r['p50_ms']:.0f} / {r['p95_ms']:.0f} / "
              f"{r['max_ms']:.0f} | {r['thinking_tokens_mean']:.1f} |")
    result = {"deadline_ms": args.deadline_ms, "machine": machine(), "levels": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
