"""Thousands of aborts through the real engine core, in every state a request can be in, and nothing leaks.

A tiny random-weight model, a pool small enough to preempt and a step budget small enough to chunk prompts: requests
(greedy, sampled, with prompt logprobs, with grammars compiling, repeated prompts sharing cached blocks) arrive at
random, and at random moments random ids are aborted: waiting, compiling, mid-prefill, decoding, preempted, just
finished, or never known. After every step the block manager's integrity holds and the runner holds a block-table
row for exactly the requests it must; at the end the pool is whole and no request is left anywhere.

The run is the same on every machine: a compile ends after a number of steps the test draws, not when the compile
thread gets to it (with real threads how many aborts land while compiling depended on the machine's speed).
"""

from __future__ import annotations

import random
from collections import Counter
from concurrent import futures

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import Grammar, GrammarCompiler

NUM_REQUESTS = 3000


def state_of(engine: EngineCore, request_id: str, finished: set[str]) -> str:
    """Where a request stands between two steps (where an abort lands: the server applies it between steps)."""
    if request_id in engine._compiling:
        return "compiling"
    request = engine.scheduler.requests.get(request_id)
    if request is None:
        return "finished" if request_id in finished else "unknown"
    if request.status == RequestStatus.PREEMPTED:
        return "preempted"
    if request.status == RequestStatus.WAITING:
        return "queued"
    if request.num_computed_tokens < request.num_prompt_tokens:
        return "mid-prefill"  # admitted, its prompt computed in part (chunks, or a cached prefix)
    return "decoding"


class StepCountedCompiles:
    """Stands in for ``GrammarCompiler.submit``: each compile's future stays pending for a drawn number of steps
    (0 to 3), then gets the real grammar, unless its request was aborted (its future cancelled) in the meantime."""

    def __init__(self, compiler: GrammarCompiler, rng: random.Random) -> None:
        self.compiler = compiler
        self.rng = rng
        self.pending: list[tuple[int, StructuredOutputsParams, futures.Future[Grammar]]] = []

    def submit(self, params: StructuredOutputsParams) -> futures.Future[Grammar]:
        future: futures.Future[Grammar] = futures.Future()
        self.pending.append((self.rng.randint(0, 3), params, future))
        return future

    def step(self) -> None:
        """One engine step has gone by: end the compiles that are due."""
        still = []
        for steps_left, params, future in self.pending:
            if future.cancelled():
                continue
            if steps_left == 0:
                future.set_result(self.compiler.grammar(params))
            else:
                still.append((steps_left - 1, params, future))
        self.pending = still


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    max_tokens = rng.randint(1, 24)
    if kind < 0.05:
        grammar = rng.choice([StructuredOutputsParams(json_object=True),
                              StructuredOutputsParams(choice=("yes", "no", "maybe"))])
        return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=grammar)
    if kind < 0.15:
        return SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=rng.randint(0, 3))
    if kind < 0.5:
        return SamplingParams(temperature=1.0, top_p=0.9, seed=rng.randrange(1000), max_tokens=max_tokens,
                              logprobs=rng.choice([None, 2]))
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)


def test_thousands_of_aborts_in_every_state_leave_the_pool_whole(tiny_model):
    engine = EngineCore(EngineConfig(model=str(tiny_model("llama-gqa-tied")), block_size=4,
                                     kv_cache_memory=128 << 10, max_num_batched_tokens=24, max_num_seqs=12,
                                     prefill_tokens_per_decode=2.0))
    bm = engine.block_manager
    rng = random.Random(31)
    compiles = StepCountedCompiles(engine.grammars, random.Random(32))
    engine.grammars = compiles
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    finished: set[str] = set()
    aborted: set[str] = set()
    states: Counter[str] = Counter()
    num_added = 0
    while num_added < NUM_REQUESTS or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 1, 1, 2]) if num_added < NUM_REQUESTS else 0):
            prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]
            engine.add_request(f"r{num_added}", prompt[:120], random_params(rng))
            num_added += 1
        if rng.random() < 0.5:
            by_state: dict[str, list[str]] = {}
            for request_id in [*engine.scheduler.requests, *engine._compiling, *sorted(finished)[-20:]]:
                by_state.setdefault(state_of(engine, request_id, finished), []).append(request_id)
            by_state["unknown"] = [f"never-{rng.randrange(10**6)}"]
            for _ in range(rng.randint(1, 3)):
                state = rng.choice(sorted(by_state))
                request_id = rng.choice(by_state[state])
                states[state] += 1
                if state not in ("finished", "unknown"):
                    aborted.add(request_id)
                engine.abort_requests([request_id])
                bm.check_integrity()
        compiles.step()
        for output in engine.step():
            assert output.request_id not in aborted, f"an output for {output.request_id} after its abort"
            if output.finished:
                finished.add(output.request_id)
        bm.check_integrity()
        assert not set(bm.block_tables) - set(engine.scheduler.requests), "a table outlived its request"
        assert set(engine.model_runner.block_tables.rows) == engine.scheduler.runner_rows(), "a row leaked"

    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine._compiling
    assert sum(states.values()) >= 2000, states
    for state in ("queued", "compiling", "mid-prefill", "decoding", "preempted", "finished", "unknown"):
        assert states[state] >= 20, f"too few aborts while {state}: {states}"
