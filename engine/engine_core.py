"""The synchronous engine loop: ``step() = schedule() -> model_runner.execute() -> update_from_output()``.

No sockets, no ``await``: the offline ``LLM`` drives it directly, and the server drives the same object in its own
process. Tokenization happens outside; requests arrive as token ids.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent import futures
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_KV_CACHE_FRACTION,
    MIN_CPU_TOKEN_BUDGET,
    EngineConfig,
    cpu_token_budget,
)
from engine.cuda_graphs import CudaGraphs
from engine.kv_cache import KVCache, KVCacheSpec, resolve_budget
from engine.limits import EngineLimits
from engine.model_loader import eos_token_ids, iter_weights, load_config, load_tokenizer, resolve_model
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM, head_dim_of, num_kv_heads_of
from engine.outputs import EngineCoreOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import NgramProposer
from engine.structured_output import Grammar, GrammarCompiler, check_grammar
from kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)
BUDGET_PROBE_TOKENS, BUDGET_PROBES = 256, 5
WARM_UP_PROMPT_LEN, WARM_UP_EARLY_PROMPTS = 128, 3
GRAMMAR_WAIT_S = 0.05  # with nothing to run but grammars compiling, how long a step waits for one


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int = 0  # of those, tokens found cached
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified, cumulative
    spec_accepted_tokens: int = 0  # of those, drafts kept


class EngineCore:
    """Owns the model, the KV pool, the block manager and the scheduler, and advances every request one step."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolve_device()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        files = resolve_model(config.model)
        self.model_name = files.name
        self.model_path = files.path
        self.hf_config = load_config(files)
        self.tokenizer = load_tokenizer(files)
        self.eos_token_ids = eos_token_ids(files, self.hf_config, self.tokenizer)
        self.vocab_size = self.hf_config.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # Requests whose grammar is compiling, in arrival order: the scheduler sees them once it is ready.
        self._compiling: dict[str, tuple[Request, futures.Future[Grammar]]] = {}
        self.max_model_len = self._max_model_len()
        self.dtype = config.resolve_dtype(self.device)
        self.kv_cache_dtype = config.resolve_kv_cache_dtype(self.dtype)

        self.attention_backend = config.resolve_attention_backend(self.device, self.dtype)
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if self.attention_backend == "triton" and self.device.type != "cuda" and not interpreted:
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for testing)")
        if self.attention_backend == "triton":
            from kernels.online_softmax import check_dot_shapes  # defines kernels: after TRITON_INTERPRET is set

            check_dot_shapes(config.block_size, head_dim_of(self.hf_config), self.device)
        if self.attention_backend == "cpu" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError("the cpu attention backend (C kernels) runs float32 on a CPU only")
        if self.attention_backend == "cpu" and not cpu_kernels.available():
            raise ValueError("the cpu attention backend needs a C compiler (cc/gcc, or $CC) to build kernels/cpu")
        started = time.monotonic()
        with torch.device(self.device):
            model = LlamaForCausalLM(self.hf_config, self.max_model_len, self.attention_backend)
        model.load_weights(iter_weights(files))
        self.model = model.to(self.dtype).eval()
        if self.attention_backend == "cpu":
            self.model.use_cpu_kernels()
        elif self.attention_backend == "triton":
            self.model.use_triton_ops()
        logger.info(
            "loaded %s (%s, %s, %s attention backend) in %.1f s",
            self.model_name,
            self.dtype,
            self.device,
            self.attention_backend,
            time.monotonic() - started,
        )

        self.kv_cache = self._allocate_kv_cache()
        logger.info(self.kv_cache.describe())
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.limits = EngineLimits(self.max_model_len, self.vocab_size, config.block_size, self.kv_cache.num_blocks)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.device, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.resolve_prefill_tokens_per_decode(self.device))
        graphs = None
        if self.device.type == "cuda" and self.attention_backend == "triton" and not config.enforce_eager:
            graphs = CudaGraphs(self.model, self.kv_cache, self.max_num_batched_tokens, config.max_num_seqs,
                                self.max_model_len, self.device)
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.device, self.vocab_size, graphs)
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None
        if config.max_num_batched_tokens is None and self.device.type == "cpu":
            self._size_token_budget()
        if self.device.type == "cuda":
            self._warm_up()

    def _size_token_budget(self) -> None:
        """Size the step's token budget to this CPU. A step past a few dozen tokens is compute-bound, so its time is
        close to tokens x the cost of one, and it is the gap every running stream waits between two tokens;
        instances of one machine kind differ 2x in that cost. Time a few prefill steps, then fix the budget so a
        full step takes about CPU_STEP_TARGET_S. It is measured once, at start-up: from then on the scheduling is
        deterministic (pass max_num_batched_tokens to fix it across machines too)."""
        block_size = self.config.block_size
        n = min(BUDGET_PROBE_TOKENS, self.max_model_len - 1, (self.kv_cache.num_blocks - 1) * block_size)
        if n < MIN_CPU_TOKEN_BUDGET // 2:
            return  # a toy pool or context: keep the default
        timings = [self._serve_made_up_prompts(i, 1, n) for i in range(BUDGET_PROBES)]
        # The first pays one-off costs (page faults, thread start-up); the fastest of the rest is the machine's
        # speed, the others caught it busy with something else.
        per_token = min(timings[1:]) / n
        budget = cpu_token_budget(per_token, block_size)
        self.max_num_batched_tokens = self.scheduler.max_num_batched_tokens = budget
        logger.info("token budget %d per step (a %d-token prefill step took %.1f ms: %.2f ms per token)",
                    budget, n, per_token * n * 1000, per_token * 1000)

    def _warm_up(self) -> None:
        """Serve bursts of made-up prompts once, before the first user. A step too big for a CUDA graph (a burst of
        new prompts) runs eagerly, and the first of its size compiles the Triton prefill kernel and loads the GEMM
        kernels for its shapes: on an H100 the first 16-prompt burst took 740 ms against 29 ms the second time, and
        still 423 ms with Triton's disk cache warm. Bursts of the whole token budget, then half of it and so on down
        to the graphs' largest step, each prompt WARM_UP_PROMPT_LEN tokens; the first prompt of each is sampled.
        A last burst comes as a first wave of users does, a few prompts a step ahead of the rest, so that its second
        step mixes their decodes into the prompts."""
        started = time.monotonic()
        length = min(WARM_UP_PROMPT_LEN, self.max_model_len - 2)
        blocks_per_prompt = -(-(length + 2) // self.config.block_size)
        most = min(self.config.max_num_seqs, self.kv_cache.num_blocks // blocks_per_prompt - 1)
        smallest = self.model_runner.graphs.max_num_tokens if self.model_runner.graphs is not None else length
        tokens, bursts = self.max_num_batched_tokens, 0
        while tokens > smallest and most > WARM_UP_EARLY_PROMPTS:
            self._serve_made_up_prompts(bursts, min(most, max(1, tokens // length)), length, sampled=True)
            tokens, bursts = tokens // 2, bursts + 1
        if bursts:
            num_prompts = min(most, self.max_num_batched_tokens // length + WARM_UP_EARLY_PROMPTS)
            self._serve_made_up_prompts(bursts, num_prompts, length, num_early=WARM_UP_EARLY_PROMPTS)
            logger.info("warmed up with %d bursts of prompts in %.1f s", bursts + 1, time.monotonic() - started)

    def _serve_made_up_prompts(self, key: int, num_prompts: int, length: int, sampled: bool = False,
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
        cfg = self.hf_config
        spec = KVCacheSpec(
            cfg.num_hidden_layers, num_kv_heads_of(cfg), head_dim_of(cfg), self.config.block_size, self.kv_cache_dtype
        )
        budget = resolve_budget(
            self.config.kv_cache_memory, self.device, DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_GPU_KV_CACHE_FRACTION
        )
        return KVCache(spec, spec.num_blocks_for(budget), self.device)

    # ---- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request, or raise ValueError (with a message for the user) if it can never be served. A request
        with a grammar waits for its compile off the step loop; a compile that fails after the grammar parsed comes
        back from a later step as an output with ``error`` set."""
        self.limits.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests or request_id in self._compiling:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.limits.resolve_max_tokens(len(prompt_token_ids), params)
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, max_tokens)
        if params.structured_outputs is None:
            self.scheduler.add_request(request)
            return
        check_grammar(params.structured_outputs)
        self._compiling[request_id] = (request, self.grammars.submit(params.structured_outputs))

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:
                compiling[1].cancel()  # if it has not started; a running compile still fills xgrammar's cache
            self.scheduler.abort_request(request_id)

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
            bm.num_query_tokens,
            bm.num_hit_tokens,
            self.scheduler.num_draft_tokens,
            self.scheduler.num_accepted_tokens,
        )

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        errors = self._admit_compiled()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return errors
        result = self.model_runner.execute(sched)
        for request_id, entries in result.prompt_logprobs.items():
            request = self.scheduler.requests[request_id]
            request.prompt_logprobs.extend(entries)
            request.num_prompt_logprobs_done += len(entries)
        num_before = {r: self.scheduler.requests[r].num_output_tokens for r in result.sampled_token_ids}
        finished = {r.request_id for r in self.scheduler.update_from_output(sched, result.sampled_token_ids)}
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        outputs = errors
        for request in sched.scheduled_requests:
            if request.request_id not in num_before:
                continue  # a prefill chunk short of the prompt's end
            token_ids = request.output_token_ids[num_before[request.request_id] :]  # a stop drops those after it
            first = request.num_output_tokens == len(token_ids)
            logprobs = result.logprobs.get(request.request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=token_ids,
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    prompt_logprobs=[None, *request.prompt_logprobs]
                    if first and request.prompt_logprobs_requested
                    else None,
                    finish_reason=request.status.value if request.request_id in finished else None,
                    stop_reason=request.stop_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    queue_time=request.first_scheduled_time - request.arrival_time if first else None,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        return outputs
