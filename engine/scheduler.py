"""Continuous batching: decides, at every step, which requests run and how many tokens each computes.

The schedule is phase-free (vLLM v1's idea): a request simply needs ``num_tokens - num_computed_tokens`` more
tokens computed. A fresh prompt needs all of them (prefill), a prompt larger than the step's token budget gets a
chunk now and the rest later (chunked prefill), and a decoding request needs one. Decodes and prefills share a
step, and requests join and leave the running batch between any two steps.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.outputs import EngineCoreOutput, ModelRunnerOutput, PositionLogprobs
from engine.request import Request, RequestStatus
from engine.spec_decode import NgramProposer
from engine.thinking import StepTimes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: the requests to run and how many new tokens each computes, and what changed in the block
    tables since the previous plan (the runner keeps the tables between steps).

    Batch order: requests with one query token (decodes) first, then prompt chunks and draft verifications;
    arrival order within each.
    """

    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    # Per scheduled request, the block ids added to its table since the runner last saw it: the whole table for a
    # request the runner does not hold (new, or back after preemption), else the blocks allocated since.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests that left since the previous plan (finished, aborted, preempted): the runner drops their tables.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Drafts to verify, per decoding request that has them: its scheduled tokens are its last token plus these.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Tokens a sampled request must emit this step (a thinking bound closing its thinking: engine/thinking.py)
    forced_token_ids: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests


class Scheduler:
    """Owns the waiting and running queues and every state change of a request but sampling itself.

    Policy: first come, first served. Both queues are kept in arrival order; running decodes are scheduled
    before prefill chunks; when the pool runs dry the *newest* running request is preempted (its blocks freed,
    to be recomputed later) and goes back to the waiting queue in arrival order, so the oldest request always
    makes progress and nothing starves. A step that had to preempt admits no new request. With prefix caching, an
    admitted request starts after its longest cached prefix, and the head of the queue waits while a running
    prefill is computing the very block it would need next (n samples of one prompt compute it once).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_tokens_per_decode: float | None = None,
        proposer: NgramProposer | None = None,
    ) -> None:
        """``proposer``: drafts the running requests' next tokens after each step (speculative decoding)."""
        self.block_manager = block_manager
        self.proposer = proposer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_tokens_per_decode = prefill_tokens_per_decode
        # A step's fixed cost (what a step of one token takes beyond one token's share: streaming the weights, the
        # per-step overhead) in tokens' worth, counted as decodes by prefill_budget; measured at start-up on a CPU.
        self.step_fixed_tokens = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrival_index: dict[str, int] = {}
        self._next_index = 0
        self.num_preemptions = 0
        self._num_sent_blocks: dict[str, int] = {}  # per request the runner holds, the table entries it was sent
        self._gone: list[str] = []  # requests the runner held that left since the last plan it ran
        self.num_draft_tokens = 0  # speculative decoding: drafts verified so far, and how many of them were kept
        self.num_accepted_tokens = 0
        self.step_times = StepTimes()  # what the engine's steps take now: thinking deadlines plan with it

    # ---- queue management ----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue ``request``; its id must be new (``EngineCore.add_request`` refuses a duplicate to the user)."""
        assert request.request_id not in self.requests, f"request id {request.request_id!r} is already in use"
        self.requests[request.request_id] = request
        self._arrival_index[request.request_id] = self._next_index
        self._next_index += 1
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish ``request_id`` as aborted in whatever state it is, freeing its blocks. Unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def runner_rows(self) -> set[str]:
        """The requests whose block-table rows the runner holds as of the plans run so far: those it was sent, and
        those gone since the last plan it ran (it frees their rows when the next one names them)."""
        return {*self._num_sent_blocks, *self._gone}

    def _key(self, request: Request) -> int:
        return self._arrival_index[request.request_id]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._forget_table(request)
        del self.requests[request.request_id]
        del self._arrival_index[request.request_id]

    def _forget_table(self, request: Request) -> None:
        """Free ``request``'s blocks; the runner learns with the next plan that its table is gone."""
        self.block_manager.free(request)
        if self._num_sent_blocks.pop(request.request_id, None) is not None:
            self._gone.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._forget_table(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=self._key)
        logger.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    # ---- the step --------------------------------------------------------------------------------------------
    def prefill_budget(self) -> int:
        """Prompt tokens the coming step may compute beside the running requests' decodes.

        With ``prefill_tokens_per_decode`` set (R), a step that decodes carries at most R prompt tokens per
        decode, counting each waiting request it could admit as a decode to be and the step's fixed cost as
        ``step_fixed_tokens`` decodes more (and at least one block's worth). A step of d decodes takes about
        a + b d (a: the fixed cost, b: a token's), so R (a / b + d) prompt tokens lengthen it, the gap between two
        tokens of every running stream, by at most a factor 1 + R, and prompts are folded into the decode steps in
        pieces (Sarathi-Serve's piggybacking). Where streaming the weights dominates a small batch's step (a / b of
        30 tokens and more on a CPU in bf16), the pieces grow to what the step can carry for that bound. The
        waiting count keeps a burst from entering one prompt at a time beside its first few streams: the budget
        follows the requests the engine holds, not how many of them it has started. A step with nothing to decode
        takes the whole token budget.
        """
        if self.prefill_tokens_per_decode is None:
            return self.max_num_batched_tokens
        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        if num_decodes == 0:
            return self.max_num_batched_tokens
        admittable = max(0, min(len(self.waiting), self.max_num_seqs - len(self.running)))
        decodes = num_decodes + admittable + self.step_fixed_tokens
        return max(self.block_manager.block_size, int(self.prefill_tokens_per_decode * decodes))

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted: list[str] = []
        prefill_budget = self.prefill_budget()
        chunked: set[str] = set()  # running requests given a prefill chunk this step
        drafts: dict[str, list[int]] = {}

        # Decodes (one token left) first, then prefill chunks; arrival order within each group (sort is stable).
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted by an older request earlier in this loop
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 1:  # a decode, with its drafts as far as the budget goes
                num_new = min(1 + len(request.spec_token_ids), budget)
            else:
                num_new = min(remaining, budget, prefill_budget)
            if num_new == 0:
                continue  # a prefill chunk with no prompt budget left this step
            while self.block_manager.allocate_slots(request, num_new) is None:
                victim = self.running[-1]  # the newest
                if victim.request_id in num_scheduled:
                    freed = num_scheduled.pop(victim.request_id)
                    budget += freed
                    if victim.request_id in chunked:
                        prefill_budget += freed
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                num_scheduled[request.request_id] = num_new
                budget -= num_new
                if remaining == 1 and num_new > 1:
                    drafts[request.request_id] = request.spec_token_ids[: num_new - 1]
                if remaining > 1:
                    prefill_budget -= num_new
                    chunked.add(request.request_id)

        pending = self._pending_block_hashes() if self.waiting and self.block_manager.enable_caching else set()
        while (self.waiting and min(budget, prefill_budget) > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            computed = self.block_manager.get_computed_blocks(request)
            hashes = request.block_hashes
            if (len(computed) < len(hashes) and hashes[len(computed)] in pending
                    and not request.prompt_logprobs_requested):
                break  # a running prefill is computing this request's next block: wait a step and share it
            num_computed = len(computed) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_computed, budget, prefill_budget)
            if self.block_manager.allocate_slots(request, num_new, computed) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.pop(0)
            request.num_computed_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._key)
            if self.block_manager.enable_caching:
                pending.update(self._blocks_being_prefilled(request))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            prefill_budget -= num_new

        scheduled = sorted((r for r in self.running if r.request_id in num_scheduled),
                           key=lambda r: num_scheduled[r.request_id] != 1)  # batch order (stable: arrival order)
        drafts = {rid: d for rid, d in drafts.items() if rid in num_scheduled}  # minus those preempted since
        finished: list[str] = []
        if scheduled:  # an empty plan is not run: the runner learns of the requests gone with the next one it runs
            finished, self._gone = self._gone, []
        return SchedulerOutput(scheduled, num_scheduled, self._new_block_ids(scheduled), finished, preempted, drafts,
                               self._forced_tokens(scheduled, num_scheduled))

    def _forced_tokens(self, scheduled: list[Request], num_scheduled: dict[str, int]) -> dict[str, int]:
        """The tokens that requests sampling this step must emit to keep their thinking bounds."""
        forced = {}
        now = time.monotonic()
        for request in scheduled:
            thinking = request.thinking
            if (thinking is not None and thinking.may_force
                    and request.num_computed_tokens + num_scheduled[request.request_id] == request.num_tokens):
                token_id = thinking.forced_token(now, self.step_times.step_s)
                if token_id is not None:
                    forced[request.request_id] = token_id
        return forced

    def _new_block_ids(self, scheduled: list[Request]) -> dict[str, list[int]]:
        """What each scheduled request's table gained since it was last sent (tables only ever grow, or go)."""
        new = {}
        for request in scheduled:
            table = self.block_manager.get_block_ids(request.request_id)
            new[request.request_id] = table[self._num_sent_blocks.get(request.request_id, 0) :]
            self._num_sent_blocks[request.request_id] = len(table)
        return new

    def _pending_block_hashes(self) -> set[int]:
        """Hashes of the full prompt blocks that running requests are still prefilling."""
        return {h for request in self.running for h in self._blocks_being_prefilled(request)}

    def _blocks_being_prefilled(self, request: Request) -> list[int]:
        size = self.block_manager.block_size
        if request.num_computed_tokens >= request.num_prompt_tokens:
            return []
        hashes = request.update_block_hashes(size)
        return hashes[request.num_computed_tokens // size : request.num_prompt_tokens // size]

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance the scheduled requests by what the step computed: record prompt logprobs, append the new tokens
        (several where drafts were accepted; none for a prefill chunk short of the prompt's end), finish the requests
        that hit a stop condition (dropping any tokens after it), propose the next drafts; return what each request
        that reached its last token produced."""
        outputs: list[EngineCoreOutput] = []
        for request in output.scheduled_requests:
            request_id = request.request_id
            entries = result.prompt_logprobs.get(request_id)
            if entries:
                request.prompt_logprobs.extend(entries)
                request.num_prompt_logprobs_done += len(entries)
            token_ids = result.sampled_token_ids.get(request_id)
            pooled = result.pooled.get(request_id)
            num_before = request.num_output_tokens
            num_drafts = len(output.spec_token_ids.get(request_id, ()))
            if num_drafts:
                self.num_draft_tokens += num_drafts
                self.num_accepted_tokens += len(token_ids) - 1
            status = None
            for token_id in token_ids or ():
                request.append_output_token(token_id)
                status = self._stop_status(request, token_id)
                if status is not None:
                    break
            # The rejected drafts' K/V (written past the accepted ones) is not counted: the next step overwrites it.
            num_rejected = num_drafts + 1 - len(token_ids) if num_drafts else 0
            num_computed = request.num_computed_tokens + output.num_scheduled_tokens[request_id] - num_rejected
            assert status is not None or num_computed <= request.num_tokens
            request.num_computed_tokens = min(num_computed, request.num_tokens)  # tokens after a stop were dropped
            self.block_manager.cache_full_blocks(request)
            if pooled is not None:  # an embedding: the prompt was all there was to compute
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self._finish(request, status)
            if token_ids is not None or pooled is not None:
                outputs.append(_core_output(request, num_before, result.logprobs.get(request_id), pooled))
        if self.proposer is not None:
            self.proposer.propose(self.running)
        return outputs

    @staticmethod
    def _stop_status(request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        grammar = request.grammar
        if grammar is not None and grammar.rejected:  # NOTE: the mask allows only accepted tokens; a bug, not input
            logger.error("request %s: token %d is outside its grammar", request.request_id, token_id)
            return RequestStatus.FINISHED_ABORTED
        if grammar is not None and grammar.terminated:  # complete, an end-of-sequence token accepted (even ignore_eos)
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def _core_output(request: Request, num_before: int, logprobs: PositionLogprobs | None,
                 pooled: list[float] | None = None) -> EngineCoreOutput:
    """What a step produced for ``request``, which had ``num_before`` output tokens before it."""
    first = num_before == 0
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=request.output_token_ids[num_before:],  # a stop drops those after it
        new_logprobs=[logprobs] if logprobs is not None else None,
        prompt_logprobs=[None, *request.prompt_logprobs] if first and request.prompt_logprobs_requested else None,
        finish_reason=request.status.value if request.is_finished else None,
        stop_reason=request.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        queue_time=request.first_scheduled_time - request.arrival_time if first else None,
        num_cached_tokens=request.num_cached_tokens,
        pooled=pooled,
    )
