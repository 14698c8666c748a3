"""Random traffic through the scheduler and the block manager, against a stand-in model that reads its context
from a shadow KV pool through the block tables.

The real engine's correctness rests on the bookkeeping: every slot a request's attention reads must hold the K/V
of that request's own token at that position, whatever else shares the pool (prefix-cache hits, preemption and
recompute, rejected drafts, aborts, chunked prefills beside decodes). The stand-in writes (position, token) into
the slots the block tables name, as the model's K/V store does, then checks every slot each request reads, as its
attention would. Its next token is a hash of the whole context, so a request's output depends on every token
before it; at the end each request's output must equal what the same request gets alone (the property the engine
keeps against transformers), and the pool must be whole again. Seeds, pool sizes and policies vary per case.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.block_manager import BlockManager
from engine.block_table import BlockTables
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import accepted_tokens

VOCAB = 11  # small, so that drafts, stop tokens and shared prefixes happen often
EOS = 0


def next_token(context: list[int]) -> int:
    """The stand-in model's greedy token after ``context``: depends on every token and its position."""
    h = 0
    for token in context:
        h = (h * 1_000_003 + token + 1) % (1 << 61)
    return h % VOCAB


def run_alone(prompt: list[int], params: SamplingParams, max_tokens: int) -> tuple[list[int], RequestStatus]:
    """The reference: the request by itself, one token at a time, with the stop rules of the API."""
    tokens, output = list(prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if len(output) >= params.min_tokens and (
            (token == EOS and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return output, RequestStatus.FINISHED_STOPPED
        if len(output) >= max_tokens:
            return output, RequestStatus.FINISHED_LENGTH


class ShadowModel:
    """Plays the model runner over a pool of (position, token) slots instead of K/V vectors, keeping the block
    tables from the plans' deltas as the runner does (and checking them against the block manager's)."""

    def __init__(self, bm: BlockManager, max_num_seqs: int) -> None:
        self.bm = bm
        self.block_size = bm.block_size
        self.slots: list[tuple[int, int] | None] = [None] * (bm.num_blocks * bm.block_size)
        self.tables = BlockTables(max_num_seqs, bm.num_blocks)

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Store every scheduled token's entry, then (as attention runs after the whole batch's stores) read each
        request's context back through its table and sample where the chunk reaches its last token."""
        inputs = {}
        self.tables.update(out.finished_request_ids, out.new_block_ids)
        for request_id, row in self.tables.rows.items():
            held = self.tables.table[row, : self.tables.num_blocks[row]].tolist()
            assert held == self.bm.get_block_ids(request_id), f"{request_id}: the runner's table is stale"
        for request in out.scheduled_requests:
            start, drafts = request.num_computed_tokens, out.spec_token_ids.get(request.request_id, [])
            end = start + out.num_scheduled_tokens[request.request_id]
            tokens = request.all_token_ids[: end - len(drafts)] + drafts  # the known tokens, then the guesses
            table = self.bm.get_block_ids(request.request_id)
            assert len(table) * self.block_size >= end, f"{request.request_id}: table too short for {end} tokens"
            for position in range(start, end):
                self.slots[self._slot(table, position)] = (position, tokens[position])
            inputs[request.request_id] = (end, drafts, tokens, table, end == request.num_tokens + len(drafts))
        sampled = {}
        for request_id, (end, drafts, tokens, table, at_last_token) in inputs.items():
            for position in range(end):
                entry = self.slots[self._slot(table, position)]
                assert entry == (position, tokens[position]), (
                    f"{request_id} reads {entry} at position {position}, expected {(position, tokens[position])}"
                )
            if drafts:
                targets = [next_token(tokens[: p + 1]) for p in range(end - len(drafts) - 1, end)]
                sampled[request_id] = accepted_tokens(drafts, targets)
            elif at_last_token:
                sampled[request_id] = [next_token(tokens)]
        return sampled


@dataclass
class Case:
    seed: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    budget: int
    prefill_tokens_per_decode: float | None
    caching: bool
    draft_rate: float
    abort_rate: float


def _cases() -> list[Case]:
    rng = random.Random(1234)
    return [
        Case(
            seed=i,
            num_blocks=rng.randint(12, 48),
            block_size=rng.choice([2, 4, 16]) if i % 5 else 4,
            max_num_seqs=rng.randint(1, 8),
            budget=rng.choice([8, 16, 32, 64]),
            prefill_tokens_per_decode=rng.choice([None, 1.0, 2.0, 3.0]),
            caching=i % 3 != 0,
            draft_rate=rng.choice([0.0, 0.5, 1.0]),
            abort_rate=rng.choice([0.0, 0.05]),
        )
        for i in range(36)
    ]


def _drafts(rng: random.Random, request: Request) -> list[int]:
    """Up to 4 guesses at the request's continuation: right up to a random point, then (sometimes) wrong."""
    num = min(rng.randint(1, 4), request.max_tokens - request.num_output_tokens - 1)
    tokens, drafts = list(request.all_token_ids), []
    for _ in range(max(0, num)):
        token = next_token(tokens) if rng.random() < 0.7 else rng.randrange(VOCAB)
        tokens.append(token)
        drafts.append(token)
    return drafts


def _new_request(rng: random.Random, request_id: str, earlier: dict[str, Request], prefixes: list[list[int]],
                 capacity: int) -> Request:
    """A prompt on one of a few shared prefixes, now and then one seen before (n > 1, a repeated question), with
    random stop rules; prompt and output fit ``capacity`` tokens (max_model_len)."""
    if earlier and rng.random() < 0.15:
        prompt = list(rng.choice(list(earlier.values())).prompt_token_ids)
    else:
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
    prompt = prompt[: capacity - 1]
    max_tokens = min(rng.randint(1, 40), capacity - len(prompt))
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.5,
        min_tokens=min(rng.choice([0, 0, 3]), max_tokens),
        stop_token_ids=tuple(rng.sample(range(1, VOCAB), rng.randint(0, 1))),
    )
    return Request(request_id, prompt, params, frozenset({EOS}), max_tokens)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"seed{c.seed}")
def test_random_traffic_reads_only_its_own_kv_and_leaves_the_pool_whole(case: Case):
    rng = random.Random(case.seed)
    bm = BlockManager(case.num_blocks, case.block_size, enable_caching=case.caching)
    sched = Scheduler(bm, case.max_num_seqs, case.budget, case.prefill_tokens_per_decode)
    model = ShadowModel(bm, case.max_num_seqs)
    capacity = case.num_blocks * case.block_size  # what one request may hold at most
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 40))] for _ in range(3)]
    expected: dict[str, tuple[list[int], RequestStatus]] = {}
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    num_requests, steps = 40, 0

    while len(requests) < num_requests or sched.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4]) if len(requests) < num_requests else 0):
            request = _new_request(rng, f"r{len(requests)}", requests, prefixes, capacity)
            requests[request.request_id] = request
            expected[request.request_id] = run_alone(request.prompt_token_ids, request.sampling_params,
                                                     request.max_tokens)
            sched.add_request(request)
        if case.abort_rate and rng.random() < case.abort_rate and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_request(victim)
            aborted.add(victim)
            assert victim not in bm.block_tables
        for request in sched.running:
            decoding = request.num_tokens - request.num_computed_tokens == 1
            request.spec_token_ids = _drafts(rng, request) if decoding and rng.random() < case.draft_rate else []

        prefill_budget = sched.prefill_budget()
        prefilling = {r.request_id for r in sched.running + sched.waiting if r.num_tokens - r.num_computed_tokens > 1}
        out = sched.schedule()
        bm.check_integrity()
        assert out.total_num_scheduled_tokens <= case.budget
        assert all(n > 0 for n in out.num_scheduled_tokens.values()), out.num_scheduled_tokens  # a row to sample
        assert len(sched.running) <= case.max_num_seqs
        assert sum(n for r, n in out.num_scheduled_tokens.items() if r in prefilling) <= prefill_budget
        for request_id in out.preempted_request_ids:
            assert request_id not in bm.block_tables and request_id not in out.num_scheduled_tokens
        if not out.is_empty:  # as the engine: an empty plan is not run
            sched.update_from_output(out, ModelRunnerOutput(model.execute(out)))
        bm.check_integrity()
        assert set(model.tables.rows) == sched.runner_rows(), "a row leaked"  # empty plans or not
        steps += 1
        assert steps < 5000, "the traffic stopped making progress"

    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables
    for request_id, request in requests.items():
        if request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            continue
        output, status = expected[request_id]
        assert (request.output_token_ids, request.status) == (output, status), request_id
