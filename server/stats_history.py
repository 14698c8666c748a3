"""The engine's load over the last minutes, one sample a second, for the dashboard's charts.

Prometheus keeps history for those who run it; the dashboard must work without one, so the API process keeps a
small ring of its own: a sample is taken on the first step after a second has passed (a float compare per step
otherwise), and on a poll after an idle second, so quiet periods show as zero rather than as a gap.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from engine.outputs import EngineStats

DEFAULT_SECONDS = 600


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic()
    running: int
    waiting: int
    kv_cache_usage: float
    free_blocks: int
    generated_tokens: int  # cumulative, over the server's life (engine restarts included)


class StatsHistory:
    def __init__(self, seconds: int = DEFAULT_SECONDS, interval: float = 1.0) -> None:
        self.interval = interval
        self.samples: deque[Sample] = deque(maxlen=max(2, int(seconds / interval)))

    def observe(self, now: float, stats: EngineStats, generated_tokens: int) -> None:
        """Take a sample if ``interval`` has passed since the last one."""
        if self.samples and now - self.samples[-1].t < self.interval:
            return
        self.samples.append(Sample(now, stats.num_running, stats.num_waiting, stats.kv_cache_usage,
                                   stats.num_free_blocks, generated_tokens))

    def as_json(self) -> dict:
        """The samples, each with the output tok/s since the one before it (None for the first)."""
        rows, previous = [], None
        for s in self.samples:
            row = asdict(s)
            row["tokens_per_s"] = (None if previous is None
                                   else (s.generated_tokens - previous.generated_tokens) / (s.t - previous.t))
            rows.append(row)
            previous = s
        return {"interval_s": self.interval, "samples": rows}
