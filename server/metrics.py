"""Prometheus metrics, named after vLLM's with a ``harpoon:`` prefix so existing dashboards adapt easily."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from engine.outputs import EngineStats

disable_created_metrics()  # the *_created series only add noise to dashboards

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
        self.num_restarts = 0
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "drafts": 0, "accepted": 0}
        self._stats: EngineStats | None = None

    def update_engine(self, stats: EngineStats) -> None:
        """Keeps the engine's latest stats; they reach the gauges and counters when rendered. NOTE: setting them on
        every step (each a lock) was ~8% of the server's CPU per streamed token."""
        self._stats = stats

    def engine_restarted(self) -> None:
        """A new engine counts its totals from zero: so do the increments taken from them."""
        self.engine_restarts.inc()
        self.num_restarts += 1
        self.engine_up.set(1)
        self._seen = dict.fromkeys(self._seen, 0)
        self._stats = None

    def _apply_engine_stats(self) -> None:
        stats = self._stats
        if stats is None:
            return
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.kv_cache_free_blocks.set(stats.num_free_blocks)
        # The engine reports cumulative counts; Prometheus counters take increments.
        for key, counter, value in (("preemptions", self.num_preemptions, stats.num_preemptions),
                                    ("queries", self.prefix_cache_queries, stats.prefix_cache_queries),
                                    ("hits", self.prefix_cache_hits, stats.prefix_cache_hits),
                                    ("drafts", self.spec_decode_num_draft_tokens, stats.spec_draft_tokens),
                                    ("accepted", self.spec_decode_num_accepted_tokens, stats.spec_accepted_tokens)):
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
                self._seen[key] = value

    def render(self) -> bytes:
        self._apply_engine_stats()
        return generate_latest(self.registry)
