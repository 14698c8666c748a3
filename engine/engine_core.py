"""The synchronous engine loop: ``step() = schedule() -> model_runner.execute() -> update_from_output()``.

No sockets, no ``await``: the offline ``LLM`` drives it directly, and the server drives the same object in its own
process. Tokenization happens outside; requests arrive as token ids.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent import futures

import torch
from transformers import PreTrainedTokenizerBase

from engine.backends import resolve_dtype, select_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kernel_plan import KernelPlan, plan_kernels
from engine.kv_cache import KVCache, KVCacheSpec
from engine.limits import EngineLimits
from engine.memory_ledger import LedgerProbe, MemoryLedger, held_tensor_bytes
from engine.model_loader import eos_token_ids, load_config, load_tokenizer, resolve_model
from engine.model_runner import ModelRunner
from engine.models import load_model
from engine.models.llama import head_dim_of
from engine.models.moe import token_flops
from engine.outputs import EngineCoreOutput, EngineStats, ModelRunnerOutput, StepCounters
from engine.pooler import Pooler
from engine.pooling import pooling_spec
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import NgramProposer
from engine.start_up import burst_room, probe_room, size_cpu_token_budget, warm_up_bursts
from engine.structured_output import Grammar, GrammarCompiler, check_grammar
from engine.tensor_parallel import Shard
from engine.thinking import StepTimes, ThinkingState
from engine.timeline import Timelines
from engine.tp_workers import TPWorkers

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # with nothing to run but grammars compiling, how long a step waits for one


class EngineCore:
    """Owns the model, the KV pool, the block manager and the scheduler, and advances every request one step."""

    def __init__(self, config: EngineConfig, own_process: bool = False) -> None:
        """``own_process``: a server's engine process, where the backend measures the machine once started
        (``after_start_up``; in-process engines, as the tests make by the hundred, skip its second of timing)."""
        self.config = config
        self.device = config.resolve_device()
        torch.manual_seed(config.seed)
        files = resolve_model(config.model)
        self.model_name = files.name
        self.model_path = files.source
        self.hf_config = load_config(files)
        # Built on first use: the engine itself needs it only for a grammar's token masks (the server's API process
        # has its own), and a large vocabulary's takes transformers ~5 s and ~350 MB. Not a method of the engine: the
        # compiler holding one would make a cycle, and the engine (its KV pool) would outlive its last reference.
        self._tokenizer = functools.cache(functools.partial(load_tokenizer, files))
        self.eos_token_ids = eos_token_ids(files, self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.pooling = pooling_spec(files, self.hf_config, config.runner)  # None: the model generates
        self.grammars = GrammarCompiler(self._tokenizer, self.vocab_size, self.eos_token_ids)
        # Requests whose grammar is compiling, in arrival order: the scheduler sees them once it is ready.
        self._compiling: dict[str, tuple[Request, futures.Future[Grammar]]] = {}
        self.max_model_len = self._max_model_len()
        probe = LedgerProbe(self.device)
        self.dtype = resolve_dtype(config, self.device, self.hf_config)
        self.kv_cache_dtype = config.resolve_kv_cache_dtype(self.dtype, self.device)
        tp = config.tensor_parallel_size
        if tp > 1 and self.pooling is not None:
            raise ValueError("an embedding model runs on one rank: tensor_parallel_size must be 1")
        shard = Shard(0, tp, self.hf_config) if tp > 1 else None  # checks the split before any process starts
        self.backend = select_backend(config, self.device, self.dtype)
        self.backend.check_shapes(config.block_size, head_dim_of(self.hf_config))

        started = time.monotonic()
        # ranks 1..N-1 load their parts while this process loads rank 0's
        self.tp_workers = TPWorkers(config, self.hf_config.hidden_size, self.dtype, self.max_model_len) \
            if shard else None
        try:
            self.model = load_model(files, self.hf_config, self.max_model_len, self.backend, self.device, self.dtype,
                                    shard, self.tp_workers and self.tp_workers.all_reduce, self.pooling is not None)
            if self.tp_workers is not None:
                self.tp_workers.wait_ready()
        except BaseException:
            self.close()
            raise
        # GEMM FLOPs of a token through the layers, and of a row through the LM head (the step counters' gemm_flops);
        # a tensor-parallel rank's are 1/N of the layers'
        self._token_flops = token_flops(self.model.layers)
        self._logit_row_flops = 2 * self.model.lm_head.in_features * self.model.lm_head.out_features
        logger.info("loaded %s (%s, %s, %s%s) in %.1f s", self.model_name, self.dtype, self.device,
                    self.backend.describe(), f", tensor parallel over {tp} ranks" if tp > 1 else "",
                    time.monotonic() - started)
        # the choices made while packing; the engine adds the kernels' open ones and its own at start-up (_warm_up)
        self.kernel_plan = KernelPlan(tuple(self.backend.packing_choices()))

        self.kv_cache = self._allocate_kv_cache()
        if self.tp_workers is not None:
            self.tp_workers.allocate(self.kv_cache.num_blocks)
        logger.info(self.kv_cache.describe())
        # NOTE: an embedding's pooling reads every prompt token's hidden state: no prefix is skipped
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size,
                                          config.enable_prefix_caching and self.pooling is None)
        self.limits = EngineLimits(self.max_model_len, self.vocab_size, config.block_size, self.kv_cache.num_blocks)
        self.max_num_batched_tokens = (config.max_num_batched_tokens
                                       or self.backend.max_num_batched_tokens(self.max_model_len))
        spec = config.speculative_config
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   self.backend.prefill_tokens_per_decode(),
                                   NgramProposer(spec) if spec is not None else None)
        self.backend.bind(self.model, self.kv_cache, self.max_num_batched_tokens, self.max_model_len)
        self.counters = StepCounters()
        self.timelines: Timelines | None = None  # made once warmed up: the start-up's made-up prompts are not kept
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.backend, self.vocab_size, config.max_num_seqs,
                                        self.max_model_len, self.tp_workers,
                                        Pooler(self.pooling) if self.pooling is not None else None)
        # NOTE: before the warm-up's workspace is measured: the timings' buffers (the screen's cache flush) are no
        # step's workspace
        self.kernel_plan = self.kernel_plan.with_rows(plan_kernels(self.backend))
        probe.measure_workspace(self._warm_up)
        self.timelines = Timelines(config.request_timelines) if config.request_timelines else None
        self.memory_ledger = self._memory_ledger(probe)
        for line in self.memory_ledger.lines():
            logger.info(line)
        if own_process:
            # NOTE: the kernels' choices timed again, now that the API process has loaded: they keep the same bits,
            # so they can change here. Timed while it loaded (2 cores), one server read "vnni 0.56, maddubs 0.44" ms
            # (0.16 and 0.26 on the idle machine), kept maddubs, and served 17-20% fewer tokens at 16 and 64 clients
            # than the next start, which kept VNNI; five starts of the default server kept the int8 screen at 1-1,
            # 1-1, 1-16, 1-256 and 4-256 rows, an idle process 4-256 five times in six (docs/history/).
            self.kernel_plan = self.kernel_plan.with_rows(plan_kernels(self.backend))
            self.backend.after_start_up()
            logger.info("kernel plan, timed again once started:\n%s", self.kernel_plan.table())
        self.scheduler.step_times = StepTimes()  # the start-up's steps are no load
        self.backend.started()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer()

    def serve_made_up_prompts(self, key: int, num_prompts: int, length: int, sampled: bool = False,
                               num_early: int = 0) -> float:
        """Serve ``num_prompts`` made-up prompts of ``length`` tokens (``key`` varies them) to their one new token, the
        first one drawn at random (seeded) where ``sampled``; the seconds it took. ``num_early`` of them come a step
        before the rest, and those ask for two tokens, so they decode beside the rest's prompts. For start-up only:
        the prefix cache's counters are left as they were."""
        bm = self.block_manager
        queries, hits = bm.num_query_tokens, bm.num_hit_tokens
        for i in range(num_prompts):
            ids = [(7919 * (key + 1000 * i) + 104729 * j) % self.vocab_size for j in range(length)]
            greedy = not (sampled and i == 0)
            params = SamplingParams(temperature=0 if greedy else 1.0, seed=None if greedy else 0,
                                    max_tokens=2 if i < num_early else 1)
            self.add_request(f"start-up-{key}-{i}", ids, params)
            if i + 1 == num_early:
                self.step()
        start = time.perf_counter()
        while self.has_unfinished_requests():
            self.step()
        bm.num_query_tokens, bm.num_hit_tokens = queries, hits
        return time.perf_counter() - start

    def _warm_up(self) -> None:
        """Before the first request, once the kernels' open choices are timed (``engine/kernel_plan.py``), what the
        backend says it needs (``engine/start_up.py``): a CPU's step budget timed, unless the user set one; a GPU's
        eager kernels compiled and loaded by bursts of made-up prompts. The plan is logged as a table."""
        if self.backend.sizes_token_budget() and self.config.max_num_batched_tokens is None:
            room = probe_room(self.max_model_len, self.kv_cache.num_blocks, self.config.block_size)
            budget = size_cpu_token_budget(self.serve_made_up_prompts, room, self.config.block_size)
            if budget is not None:
                self.max_num_batched_tokens = self.scheduler.max_num_batched_tokens = budget.max_num_batched_tokens
                self.scheduler.step_fixed_tokens = budget.step_fixed_tokens
                self.kernel_plan = self.kernel_plan.with_rows([budget.row()])
        if self.kernel_plan.rows:
            logger.info("kernel plan:\n%s", self.kernel_plan.table())
        smallest = self.backend.warm_up_down_to(self.max_model_len)
        if smallest is not None:
            most, length = burst_room(self.config.max_num_seqs, self.kv_cache.num_blocks, self.config.block_size,
                                      self.max_model_len)
            warm_up_bursts(self.serve_made_up_prompts, self.max_num_batched_tokens, most, length, smallest)

    def _max_model_len(self) -> int:
        limit = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        # NOTE: sliding-window attention is not implemented; capping the length at the window makes full attention
        # exact for every sequence we accept.
        window = getattr(self.hf_config, "sliding_window", None)
        layer_types = getattr(self.hf_config, "layer_types", None)
        if window and (layer_types is None or "sliding_attention" in layer_types):
            limit = min(limit, int(window))
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ValueError(f"max_model_len {self.config.max_model_len} exceeds what the model supports ({limit})")
            limit = self.config.max_model_len
        return limit

    def _allocate_kv_cache(self) -> KVCache:
        """The pool in the backend's budget; under tensor parallelism every rank holds the same blocks of its own
        KV heads, and all the ranks' pools together keep to the budget."""
        spec = KVCacheSpec.of_model(self.model.config, self.config.block_size, self.kv_cache_dtype)
        budget = self.backend.kv_cache_bytes() // self.config.tensor_parallel_size
        return KVCache(spec, spec.num_blocks_for(budget), self.device)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they also stop by themselves when this process ends)."""
        if self.tp_workers is not None:
            self.tp_workers.close()
            self.tp_workers = None

    def _memory_ledger(self, probe: LedgerProbe) -> MemoryLedger:
        pool = [t for pair in self.kv_cache.layers for t in pair]
        pool_bytes = sum(t.nbytes for t in pool)  # on a CPU all views of one mapping (engine/kv_cache.py)
        if pool_bytes != self.kv_cache.num_bytes:  # the formula is the pool, or the ledger lies
            raise AssertionError(f"KV pool holds {pool_bytes} bytes, its formula says {self.kv_cache.num_bytes}")
        weights = held_tensor_bytes([self.model, *self.backend.weight_holders()], self.device, exclude=pool)
        return probe.ledger(weights, self.kv_cache.num_bytes, self.kv_cache.formula(),
                            self.backend.cuda_graph_bytes())

    # ---- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request, or raise ValueError (with a message for the user) if it can never be served. A request
        with a grammar waits for its compile off the step loop; a compile that fails after the grammar parsed comes
        back from a later step as an output with ``error`` set. ``arrival_time``: when it reached the server
        (``time.monotonic()``), for its timeline."""
        self.limits.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests or request_id in self._compiling:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.limits.resolve_max_tokens(len(prompt_token_ids), params)
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, max_tokens)
        if params.thinking is not None:
            arrived = arrival_time if arrival_time is not None else time.monotonic()
            request.thinking = ThinkingState(params.thinking, request.prompt_token_ids, arrived)
        if params.structured_outputs is None:
            self.scheduler.add_request(request)
        else:
            check_grammar(params.structured_outputs)
            self._compiling[request_id] = (request, self.grammars.submit(params.structured_outputs))
        if self.timelines is not None:
            self.timelines.arrived(request_id, len(prompt_token_ids), arrival_time)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:
                compiling[1].cancel()  # if it has not started; a running compile still fills xgrammar's cache
            self.scheduler.abort_request(request_id)
            if self.timelines is not None:
                self.timelines.aborted(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._compiling)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand the requests whose grammars are ready to the scheduler, in arrival order; a grammar that failed
        finishes its request with an error. With nothing else to run, first wait a little for a compile to end."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished_requests():
            pending = [future for _, future in self._compiling.values()]
            futures.wait(pending, timeout=GRAMMAR_WAIT_S, return_when=futures.FIRST_COMPLETED)
        errors = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                request.grammar = future.result()
            except ValueError as e:
                errors.append(EngineCoreOutput(request_id, [], finish_reason="abort", error=str(e)))
                continue
            self.scheduler.add_request(request)
        return errors

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            self.scheduler.num_running,
            self.scheduler.num_waiting + len(self._compiling),
            bm.usage,
            bm.num_free_blocks,
            bm.num_blocks,
            self.scheduler.num_preemptions,
            num_cached_blocks=len(bm.cached_blocks),
            prefix_cache_queries=bm.num_query_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            steps=dataclasses.replace(self.counters),
        )

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        outputs = self._admit_compiled()
        scheduled = self.scheduler.schedule()
        if not scheduled.is_empty:
            scheduled_at = time.perf_counter()
            result = self.model_runner.execute(scheduled)
            executed_at = time.perf_counter()
            if self.timelines is not None:  # before the update: it reads what each request had computed
                self.timelines.stepped(scheduled, *_monotonic(scheduled_at, executed_at))
            outputs += self.scheduler.update_from_output(scheduled, result)
            self._count_step(scheduled, result, scheduled_at - start, time.perf_counter() - executed_at)
        self.scheduler.step_times.stepped(start, not scheduled.is_empty, self.has_unfinished_requests())
        if self.timelines is not None:
            self.timelines.produced(outputs)
        return outputs

    def kv_view(self) -> dict:
        """The KV pool now: counts, each request's blocks, and the block map (``BlockManager.view``)."""
        computed = {r.request_id: r.num_computed_tokens for r in self.scheduler.requests.values()}
        return self.block_manager.view(computed)

    def _count_step(self, scheduled: SchedulerOutput, result: ModelRunnerOutput, schedule_s: float,
                    update_s: float) -> None:
        c = self.counters
        num_tokens = scheduled.total_num_scheduled_tokens
        c.num_steps += 1
        c.num_tokens += num_tokens
        c.num_scheduled_requests += len(scheduled.num_scheduled_tokens)
        c.num_decode_tokens += sum(1 for n in scheduled.num_scheduled_tokens.values() if n == 1)
        c.num_logit_rows += result.num_logit_rows
        c.gemm_flops += num_tokens * self._token_flops + result.num_logit_rows * self._logit_row_flops
        c.schedule_s += schedule_s
        c.prepare_s += result.prepare_s
        c.forward_s += result.forward_s
        c.sample_s += result.sample_s
        c.update_s += update_s


def _monotonic(*perf_times: float) -> tuple[float, ...]:
    """``time.perf_counter()`` readings on the ``time.monotonic()`` clock the timelines use."""
    offset = time.monotonic() - time.perf_counter()
    return tuple(t + offset for t in perf_times)
