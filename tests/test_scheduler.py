"""Scheduler unit tests: no model, the test plays the model runner by handing back sampled tokens."""

import pytest
import torch

from engine.backends.base import DEFAULT_CPU_PREFILL_TOKENS_PER_DECODE, TorchBackend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

EOS = 0


def make(request_id: str, num_prompt: int, max_tokens: int = 8, **params) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    return Request(request_id, list(range(10, 10 + num_prompt)), sp, frozenset({EOS}), max_tokens)


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
                   prefill_tokens_per_decode: float | None = None):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, prefill_tokens_per_decode), bm


def finished_requests(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
    """``update_from_output`` for a step that sampled ``sampled``; the requests it finished."""
    by_id = {r.request_id: r for r in out.scheduled_requests}
    return [by_id[o.request_id] for o in sched.update_from_output(out, ModelRunnerOutput(sampled)) if o.finished]


def run_step(sched: Scheduler, bm: BlockManager, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """One step as the engine does it: every request whose chunk reaches its last token samples ``token``."""
    out = sched.schedule()
    bm.check_integrity()
    sampled = {
        r.request_id: [token]
        for r in out.scheduled_requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
    }
    finished = finished_requests(sched, out, sampled)
    bm.check_integrity()
    return out, finished


def test_prefill_then_decode_with_exact_blocks():
    sched, bm = make_scheduler()
    a = make("a", 6, max_tokens=3)
    sched.add_request(a)
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"a": 6}
    assert bm.get_block_ids("a") == [0, 1]
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"a": 1}
    out, finished = run_step(sched, bm)
    assert finished == [a] and a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [7, 7, 7]
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    sched, bm = make_scheduler(budget=8)
    a = make("a", 3, max_tokens=4)
    sched.add_request(a)
    run_step(sched, bm)  # a prefilled
    b = make("b", 20)
    sched.add_request(b)
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # a's decode first, b gets the rest of the budget
    assert b.num_computed_tokens == 7 and b.num_output_tokens == 0
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    assert b.num_output_tokens == 1  # the last chunk samples
    assert out.total_num_scheduled_tokens == 7


def test_max_num_seqs_caps_running():
    sched, bm = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make(f"r{i}", 2))
    out, _ = run_step(sched, bm)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.num_waiting == 1


def test_preempts_newest_and_readmits_in_arrival_order():
    # 4 blocks of 2 slots: two requests of 3 prompt tokens hold 2 blocks each and then need a third.
    sched, bm = make_scheduler(num_blocks=4, block_size=2)
    a, b = make("a", 3, max_tokens=4), make("b", 3, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, bm)
    assert bm.get_block_ids("a") == [0, 1] and bm.get_block_ids("b") == [2, 3]
    out, _ = run_step(sched, bm)  # position 3 still fits each request's second block
    assert out.preempted_request_ids == [] and out.num_scheduled_tokens == {"a": 1, "b": 1}
    out, _ = run_step(sched, bm)  # both need a third block for position 4: b (newest) is preempted
    assert out.preempted_request_ids == ["b"]
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.output_token_ids == [7, 7]
    assert sched.num_preemptions == 1
    assert bm.get_block_ids("a") == [0, 1, 3]
    while a.status == RequestStatus.RUNNING:
        run_step(sched, bm)
    assert a.output_token_ids == [7, 7, 7, 7]
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"b": 5}  # recompute prompt + the tokens sampled before preemption
    while not b.is_finished:
        run_step(sched, bm)
    assert b.output_token_ids == [7, 7, 7, 7]
    assert bm.num_free_blocks == 4


def test_fcfs_head_of_queue_is_not_overtaken():
    sched, bm = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make("big", 12, max_tokens=1))
    sched.add_request(make("huge", 16, max_tokens=1))
    sched.add_request(make("tiny", 1, max_tokens=1))
    out, _ = run_step(sched, bm)
    assert set(out.num_scheduled_tokens) == {"big"}  # "huge" does not fit yet, and "tiny" must wait behind it
    out, _ = run_step(sched, bm)
    assert set(out.num_scheduled_tokens) == {"huge"}
    out, _ = run_step(sched, bm)
    assert set(out.num_scheduled_tokens) == {"tiny"}


def test_stop_conditions():
    sched, bm = make_scheduler()
    eos = make("eos", 2)
    stop = make("stop", 2, stop_token_ids=[9])
    ignore = make("ignore", 2, max_tokens=2, ignore_eos=True)
    min_tok = make("min", 2, min_tokens=2)
    for r in (eos, stop, ignore, min_tok):
        sched.add_request(r)
    out = sched.schedule()
    finished = finished_requests(sched, out, {"eos": [EOS], "stop": [9], "ignore": [EOS], "min": [EOS]})
    assert {r.request_id for r in finished} == {"eos", "stop"}
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop.stop_reason == 9
    out = sched.schedule()
    finished = finished_requests(sched, out, {"ignore": [EOS], "min": [EOS]})
    assert {r.request_id for r in finished} == {"ignore", "min"}
    assert ignore.status == RequestStatus.FINISHED_LENGTH
    assert min_tok.status == RequestStatus.FINISHED_STOPPED
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


def test_abort_in_every_state():
    sched, bm = make_scheduler(num_blocks=5, block_size=2, budget=4)
    running = make("running", 2)
    chunked = make("chunked", 6)
    sched.add_request(running)
    sched.add_request(chunked)
    run_step(sched, bm)  # running prefilled (2), chunked got 2 of 6
    assert chunked.num_computed_tokens == 2 and chunked.status == RequestStatus.RUNNING
    waiting = make("waiting", 2)
    sched.add_request(waiting)
    # Grow until the pool runs out and "chunked" gets preempted.
    preempted = None
    for _ in range(10):
        out, _ = run_step(sched, bm)
        if out.preempted_request_ids:
            preempted = out.preempted_request_ids[0]
            break
    assert preempted is not None
    assert sched.requests[preempted].status == RequestStatus.PREEMPTED
    for request_id in ("waiting", preempted, "running", "chunked"):
        request = sched.requests.get(request_id)
        if request is None:
            continue
        sched.abort_request(request_id)
        assert request.status == RequestStatus.FINISHED_ABORTED
        bm.check_integrity()
    assert sched.abort_request("unknown") is None
    assert not sched.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_mid_chunked_prefill_frees_blocks():
    sched, bm = make_scheduler(num_blocks=8, block_size=2, budget=4)
    r = make("r", 10)
    sched.add_request(r)
    run_step(sched, bm)
    assert r.num_computed_tokens == 4 and bm.get_block_ids("r") == [0, 1]
    sched.abort_request("r")
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_requests_gone_before_an_empty_plan_reach_the_runner_with_the_next_plan():
    """The runner frees a request's block-table row when a plan names it gone. An empty plan is never run, so the
    names must wait for the next one: dropped, each left a row held, and the runner ran out of rows after
    ``max_num_seqs`` of them (an engine crash, seen with requests aborted while only grammars were compiling)."""
    sched, bm = make_scheduler(max_num_seqs=2)
    gone: list[str] = []
    for request_id in ("a", "b", "c", "d"):
        sched.add_request(make(request_id, 3))
        out, _ = run_step(sched, bm)
        assert out.num_scheduled_tokens == {request_id: 3} and out.finished_request_ids == gone
        sched.abort_request(request_id)
        assert sched.schedule().is_empty  # what the engine plans while it only waits for a grammar
        gone = [request_id]
    sched.add_request(make("e", 3))
    out, _ = run_step(sched, bm)
    assert out.finished_request_ids == ["d"]


def test_prefill_tokens_per_decode_bounds_the_chunks_beside_decodes():
    """A step that decodes carries at most ratio x (decodes + waiting requests it could admit) prompt tokens, never
    under one block; a step with nothing to decode takes the whole budget."""
    sched, bm = make_scheduler(num_blocks=64, budget=64, max_num_seqs=7, prefill_tokens_per_decode=1.5)
    first = [make(f"d{i}", 2, max_tokens=30) for i in range(4)]
    for r in first:
        sched.add_request(r)
    out, _ = run_step(sched, bm)
    assert out.total_num_scheduled_tokens == 8  # nothing decoding yet: all four prompts in one step
    late, longer = make("late", 40), make("longer", 40)
    sched.add_request(late)
    sched.add_request(longer)
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "late": 9}  # 1.5 x (4 decodes + 2 waiting)
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens["late"] == 7 and "longer" not in out.num_scheduled_tokens  # 1.5 x (4 + 1)
    more = [make(f"w{i}", 40) for i in range(3)]
    for r in more:
        sched.add_request(r)
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens["late"] == 9  # 4 waiting, but only 7 - 5 running = 2 of them could be admitted
    for r in first[1:] + more:
        sched.abort_request(r.request_id)
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"d0": 1, "late": 4}  # 1.5 x (1 + 1) = 3: the floor of one block (4 tokens)
    sched.abort_request("d0")
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"late": 11, "longer": 40}  # no decodes left: the whole budget


def test_a_steps_fixed_cost_counts_as_decodes_in_the_prompt_cap():
    """With a measured fixed cost of f tokens' worth, a step of d decodes carries up to ratio x (d + waiting + f)
    prompt tokens: the same bound on how much longer the step gets than its decodes alone would take."""
    sched, bm = make_scheduler(num_blocks=64, budget=64, max_num_seqs=7, prefill_tokens_per_decode=1.5)
    sched.step_fixed_tokens = 6.5
    for i in range(2):
        sched.add_request(make(f"d{i}", 2, max_tokens=30))
    run_step(sched, bm)
    sched.add_request(make("late", 40))
    out, _ = run_step(sched, bm)
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "late": 14}  # int(1.5 x (2 decodes + 1 waiting + 6.5))


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_prefill_tokens_per_decode_must_not_be_negative(bad: float):
    with pytest.raises(ValueError, match="prefill_tokens_per_decode must be >= 0"):
        EngineConfig(prefill_tokens_per_decode=bad)


def test_prefill_tokens_per_decode_default_caps_cpu_steps_only():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    def cap(device: torch.device, **config: float) -> float | None:
        return TorchBackend(EngineConfig(**config), device, torch.float32).prefill_tokens_per_decode()

    assert cap(cpu) == DEFAULT_CPU_PREFILL_TOKENS_PER_DECODE
    assert cap(gpu) is None
    assert cap(cpu, prefill_tokens_per_decode=0) is None  # 0: no cap
    assert cap(gpu, prefill_tokens_per_decode=1.5) == 1.5
