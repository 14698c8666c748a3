"""Prometheus metrics, named after vLLM's with a ``harpoon:`` prefix so existing dashboards adapt easily."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

from engine.messages import EngineInfo
from engine.outputs import STEP_PHASES, EngineStats

disable_created_metrics()  # the *_created series only add noise to dashboards

_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"harpoon:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"harpoon:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"harpoon:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for the running batch.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks", "KV-cache blocks free.")
        self.kv_cache_blocks = gauge("kv_cache_blocks", "KV-cache blocks in the pool.")
        self.kv_cache_cached_blocks = gauge("kv_cache_cached_blocks", "KV-cache blocks holding a cached prefix (in "
                                            "use, or free but kept until evicted).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests served.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (their KV recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative drafts verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Speculative drafts accepted (equal to the model's tokens).")
        self.engine_up = gauge("engine_up", "1 while an engine serves, 0 while a dead one is being replaced.")
        self.engine_deaths = counter("engine_deaths", "Engines that died or stalled (each one's requests were lost).")
        self.engine_restarts = counter("engine_restarts", "New engines started after a death.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of one request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited before its first step.")
        # The engine's steps (loadtest/serve.py's step profile is made of these): what they computed, and their busy
        # time by phase (schedule, prepare, forward, sample, update; "send": the loop's taking commands and sending
        # outputs beside the steps).
        self.engine_steps = counter("engine_steps", "Engine steps run.")
        self.engine_step_tokens = counter("engine_step_tokens", "Tokens computed by the steps.")
        self.engine_step_decode_tokens = counter("engine_step_decode_tokens", "Of those, of requests decoding one.")
        self.engine_gemm_flops = counter("engine_gemm_flops", "Floating-point operations of the steps' projections "
                                         "and LM head.")
        self.engine_busy_seconds = Counter("harpoon:engine_busy_seconds", "Engine busy time, by phase of a step.",
                                           ["model_name", "phase"], registry=r)
        self.step_seconds = histogram("engine_step_seconds", "Time of one engine step.")
        self.step_tokens = Histogram("harpoon:engine_step_tokens_per_step", "Tokens computed by one engine step.",
                                     labels, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.step_batch_size = Histogram("harpoon:engine_step_batch_size", "Requests in one engine step's batch.",
                                         labels, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.gemm_peak_flops = gauge("gemm_peak_flops", "The machine's matmul peak in the engine's dtype, measured at "
                                     "start-up (a CPU backend's).")
        self.engine_info = Info("harpoon:engine", "The engine: device, dtype, backend, ISA and GEMM choice.",
                                labels, registry=r).labels(model_name)
        self.model_name = model_name
        self.num_restarts = 0
        self._seen: dict[str, float] = {}
        self._stats: EngineStats | None = None

    def update_engine(self, stats: EngineStats) -> None:
        """Keeps the engine's latest stats; they reach the gauges and counters when rendered, but for the per-step
        histograms, observed here. NOTE: setting the gauges and counters on every step (each a lock) was ~8% of the
        server's CPU per streamed token."""
        previous, self._stats = self._stats, stats
        if previous is not None and stats.steps.num_steps == previous.steps.num_steps + 1:
            self.step_seconds.observe(stats.steps.step_s - previous.steps.step_s)
            self.step_tokens.observe(stats.steps.num_tokens - previous.steps.num_tokens)
            self.step_batch_size.observe(stats.steps.num_scheduled_requests - previous.steps.num_scheduled_requests)

    def describe_engine(self, info: EngineInfo) -> None:
        plan = info.gemm_plan or {}
        self.engine_info.info({"device": info.device, "dtype": info.dtype, "backend": info.backend,
                               "isa": plan.get("isa", ""), "gemm": ",".join(plan.get("choice", [])[:1]),
                               "kernel_plan": info.kernel_plan_labels})
        if plan.get("peak_gflops"):
            self.gemm_peak_flops.set(plan["peak_gflops"] * 1e9)

    def engine_died(self, idle: EngineStats) -> None:
        """The dead engine's last totals are counted; its requests were failed, so the gauges read ``idle``."""
        self.engine_deaths.inc()
        self.engine_up.set(0)
        self._apply_engine_stats()
        self._stats = idle

    def engine_restarted(self, idle: EngineStats) -> None:
        """A new engine counts its totals from zero: so do the increments taken from them."""
        self.engine_restarts.inc()
        self.num_restarts += 1
        self.engine_up.set(1)
        self._seen = {}
        self._stats = idle

    def _apply_engine_stats(self) -> None:
        stats = self._stats
        if stats is None:
            return
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.kv_cache_free_blocks.set(stats.num_free_blocks)
        self.kv_cache_blocks.set(stats.num_blocks)
        self.kv_cache_cached_blocks.set(stats.num_cached_blocks)
        # The engine reports cumulative counts; Prometheus counters take increments.
        steps = stats.steps
        phases = {phase: getattr(steps, f"{phase}_s") for phase in STEP_PHASES}
        phases["send"] = max(0.0, steps.loop_s - steps.step_s)
        totals = [("preemptions", self.num_preemptions, stats.num_preemptions),
                  ("queries", self.prefix_cache_queries, stats.prefix_cache_queries),
                  ("hits", self.prefix_cache_hits, stats.prefix_cache_hits),
                  ("drafts", self.spec_decode_num_draft_tokens, stats.spec_draft_tokens),
                  ("accepted", self.spec_decode_num_accepted_tokens, stats.spec_accepted_tokens),
                  ("steps", self.engine_steps, steps.num_steps), ("tokens", self.engine_step_tokens, steps.num_tokens),
                  ("decodes", self.engine_step_decode_tokens, steps.num_decode_tokens),
                  ("flops", self.engine_gemm_flops, steps.gemm_flops)]
        totals += [(phase, self.engine_busy_seconds.labels(self.model_name, phase), value)
                   for phase, value in phases.items()]
        for key, counter, value in totals:
            if value > self._seen.get(key, 0):
                counter.inc(value - self._seen.get(key, 0))
                self._seen[key] = value

    def render(self) -> bytes:
        self._apply_engine_stats()
        return generate_latest(self.registry)
