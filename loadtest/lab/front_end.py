"""What the API process alone can stream: the real server in front of an engine that computes nothing.

On a GPU the engine's step for hundreds of streams takes a few milliseconds, and the API process (HTTP, the
tokenizer, detokenizing, the SSE events, one Python thread) is what a client waits on: at 256 clients on the H200
the steps were all under 60 ms while tokens reached the clients in bursts, a second late
(docs/history/benchmarks-2026-12.md). Here the engine process is replaced by one that answers every running request with
a token each ``--step-ms`` (the prompt's own tokens in turn, so the detokenizer works on ordinary ids), so the API
process's ceiling can be measured, and changed, on any machine:

    python -m loadtest.lab.front_end --step-ms 5 --port 8100 &      # then, as against any server:
    python -m loadtest.serve --base-url http://127.0.0.1:8100 --num-prompts 512 --sweep-concurrency 256

The options after ``--step-ms`` are ``harpoon serve``'s.
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.limits import EngineLimits
from engine.messages import AbortRequests, AddRequest, DebugQuery, EngineInfo, EngineReady, Shutdown, StepOutputs
from engine.outputs import EngineCoreOutput, EngineStats, StepCounters

NUM_BLOCKS = 1 << 16


@dataclass
class FakeRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float
    num_output_tokens: int = 0


def fake_engine_process(config: EngineConfig, conn: Connection, log_level: int, step_s: float) -> None:
    """The engine process's protocol (engine/engine_process.py) with steps that only wait ``step_s``."""
    from engine.model_loader import resolve_model

    files = resolve_model(config.model)
    limits = EngineLimits(max_model_len=config.max_model_len or 4096, vocab_size=1 << 20, block_size=16,
                          num_blocks=NUM_BLOCKS)
    conn.send(EngineReady(EngineInfo(files.name, str(files.path), "none", "none", limits, "no KV cache: a fake engine",
                                     config.max_num_seqs, 1 << 16)))
    running: dict[str, FakeRequest] = {}
    counters = StepCounters()
    next_step = time.perf_counter()
    try:
        while True:
            messages = [conn.recv()] if not running else []
            while conn.poll():
                messages.append(conn.recv())
            for message in messages:
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AddRequest):
                    running[message.request_id] = FakeRequest(
                        message.prompt_token_ids, limits.resolve_max_tokens(len(message.prompt_token_ids),
                                                                            message.params), time.perf_counter())
                elif isinstance(message, AbortRequests):
                    for request_id in message.request_ids:
                        running.pop(request_id, None)
                elif not isinstance(message, DebugQuery):
                    raise TypeError(f"unexpected message {message!r}")
            if not running:
                continue
            next_step = max(next_step + step_s, time.perf_counter())
            time.sleep(max(0.0, next_step - time.perf_counter()))
            outputs = [_next_token(request_id, request) for request_id, request in running.items()]
            for output in outputs:
                if output.finished:
                    del running[output.request_id]
            counters.num_steps += 1
            counters.num_tokens += len(outputs)
            counters.forward_s += step_s
            counters.loop_s += step_s
            stats = EngineStats(len(running), 0, 0.0, NUM_BLOCKS, NUM_BLOCKS, 0, steps=counters)
            conn.send(StepOutputs(outputs, stats))
    except (EOFError, BrokenPipeError):
        pass


def _next_token(request_id: str, request: FakeRequest) -> EngineCoreOutput:
    prompt = request.prompt_token_ids
    token = prompt[request.num_output_tokens % len(prompt)]
    first = request.num_output_tokens == 0
    request.num_output_tokens += 1
    done = request.num_output_tokens >= request.max_tokens
    return EngineCoreOutput(request_id, [token], finish_reason="length" if done else None,
                            num_prompt_tokens=len(prompt) if first else 0,
                            queue_time=time.perf_counter() - request.arrival if first else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step-ms", type=float, default=5.0, help="the fake engine's step time")
    args, serve_argv = parser.parse_known_args(argv)
    import server.engine_client
    from server.cli import main as serve

    server.engine_client.run_engine_process = functools.partial(fake_engine_process, step_s=args.step_ms / 1000)
    serve(serve_argv)


if __name__ == "__main__":
    main()
