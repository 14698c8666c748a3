"""Automatic prefix caching: exact block reuse and eviction order, and identical greedy outputs on and off."""

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.scheduler import Scheduler
from tests.conftest import PROMPTS, quick

BS = 4


def make(request_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, tokens, SamplingParams(temperature=0, max_tokens=max_tokens), frozenset(), max_tokens)


def run_to_end(sched: Scheduler, bm: BlockManager) -> list[list[int]]:
    """Drive the scheduler, sampling token 7 for everyone; returns the block tables seen at the first step."""
    first_tables = None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if first_tables is None:
            first_tables = {r: list(bm.get_block_ids(r)) for r in out.num_scheduled_tokens}
        sampled = {r.request_id: [7] for r in out.scheduled_requests
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        bm.check_integrity()
    return first_tables


def test_hit_reuses_the_same_physical_blocks_and_leaves_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    sched.add_request(make("a", prompt))
    run_to_end(sched, bm)
    assert len(bm.cached_blocks) == 3  # blocks 0, 1 (prompt) and 2 (prompt tail + 2 outputs) are full
    sched.add_request(make("b", prompt + [1, 2]))  # same 10 tokens, then diverges inside block 2
    out = sched.schedule()
    b = sched.requests["b"]
    assert bm.get_block_ids("b")[:2] == [0, 1]  # the very blocks "a" computed
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert out.num_scheduled_tokens == {"b": 4}
    assert [bm.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    bm.check_integrity()

    # An exact repeat of a fully cached prompt still computes its last token (there must be logits to sample).
    c = make("c", prompt[:8])
    sched.add_request(c)
    out = sched.schedule()
    assert out.num_scheduled_tokens["c"] == 4 and c.num_computed_tokens == 4
    assert bm.get_block_ids("c")[0] == 0 and bm.blocks[0].ref_cnt == 2  # shared with "b"
    bm.check_integrity()


def test_divergence_mid_block_only_reuses_full_matching_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make("a", list(range(12)), max_tokens=1))
    run_to_end(sched, bm)
    other = list(range(6)) + [99] * 6  # agrees for block 0 and half of block 1
    sched.add_request(make("b", other, max_tokens=1))
    sched.schedule()
    assert sched.requests["b"].num_computed_tokens == 4 and bm.get_block_ids("b")[0] == 0
    assert bm.get_block_ids("b")[1] not in (1, 2)


def test_freed_cached_blocks_are_evicted_lru_and_only_when_needed():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make("a", list(range(0, 8)), max_tokens=1))  # blocks 0, 1
    run_to_end(sched, bm)
    sched.add_request(make("b", list(range(50, 58)), max_tokens=1))  # blocks 2, 3
    run_to_end(sched, bm)
    assert bm.num_free_blocks == 6 and len(bm.cached_blocks) == 4
    # Free queue: never-used 4, 5 first, then a's blocks (tail first), then b's: the LRU order of eviction.
    assert bm.free_queue.ids() == [4, 5, 1, 0, 3, 2]
    sched.add_request(make("c", list(range(200, 212)), max_tokens=1))  # needs 3 fresh blocks
    sched.schedule()
    assert bm.get_block_ids("c") == [4, 5, 1]  # evicts a's tail block, keeps a's head and all of b
    assert len(bm.cached_blocks) == 3
    run_to_end(sched, bm)
    sched.add_request(make("a2", list(range(0, 8)) + [9], max_tokens=1))
    sched.schedule()
    assert bm.get_block_ids("a2")[0] == 0 and sched.requests["a2"].num_computed_tokens == 4  # block 1 was evicted


def test_simultaneous_identical_prompts_compute_the_prefix_once():
    bm = BlockManager(num_blocks=32, block_size=BS, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(300, 318))  # 4 full blocks + 2
    for i in range(3):
        sched.add_request(make(f"s{i}", prompt))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["s0"]  # the samples wait for the block s0 is computing
    sched.update_from_output(out, ModelRunnerOutput({"s0": [7]}))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"s0": 1, "s1": 2, "s2": 2}
    assert bm.get_block_ids("s1")[:4] == bm.get_block_ids("s0")[:4] == bm.get_block_ids("s2")[:4]
    assert bm.num_hit_tokens == 2 * 16


def test_disabled_caching_never_shares():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    for name in ("a", "b"):
        sched.add_request(make(name, list(range(10))))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10, "b": 10}
    assert not bm.cached_blocks


# ---- end to end on the default model ------------------------------------------------------------------------
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not know. " * 3)


@pytest.fixture(scope="module")
def llms():
    return LLM(**quick(enable_prefix_caching=False)), LLM(**quick(enable_prefix_caching=True))


def greedy(llm: LLM, prompts: list, n: int = 1, max_tokens: int = 24) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n)
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]


def test_greedy_identical_with_caching_cold_warm_partial_and_n(llms):
    off, on = llms
    shared = [SYSTEM + p for p in PROMPTS[:4]] + [SYSTEM[:150] + "Tell me a joke.", PROMPTS[6], PROMPTS[6][:-7]]
    expected = greedy(off, shared)
    assert greedy(on, shared) == expected  # cold: shares only within the batch
    hits_before = on.engine.block_manager.num_hit_tokens
    assert greedy(on, shared) == expected  # warm: every full prompt block cached
    assert on.engine.block_manager.num_hit_tokens > hits_before
    outs = on.generate(shared[:2], SamplingParams(temperature=0, max_tokens=4))
    assert all(o.num_cached_tokens > 0 for o in outs)
    samples = greedy(on, [SYSTEM + "Name a colour."], n=3)[0]
    assert samples == [greedy(off, [SYSTEM + "Name a colour."])[0][0]] * 3
    for llm in (off, on):
        bm = llm.engine.block_manager
        bm.check_integrity()
        assert bm.num_free_blocks == bm.num_blocks


def test_greedy_identical_with_eviction_under_a_small_pool(llms):
    off, _ = llms
    small = LLM(**quick(enable_prefix_caching=True, kv_cache_memory=12 * 2 * 30 * 3 * 64 * 4 * 16))  # 12 blocks
    prompts = [SYSTEM + p for p in PROMPTS[:6]]
    expected = greedy(off, prompts)
    assert greedy(small, prompts) == expected
    assert greedy(small, list(reversed(prompts))) == list(reversed(expected))
    bm = small.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks and small.engine.scheduler.num_preemptions > 0
