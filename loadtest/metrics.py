"""Serving metrics, defined exactly as ``vllm bench serve`` defines them.

    TTFT  = time of the first streamed chunk that carries a choice - time the request was sent
    ITL   = gaps between consecutive such chunks
    TPOT  = (E2E - TTFT) / (output tokens - 1), output tokens read from the server's ``usage``
    E2E   = time of the last chunk that carries a choice - time sent
Throughputs divide by the benchmark's wall time; goodput counts requests that meet every SLO given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one request did, in seconds relative to its own send time (except ``start``)."""

    start: float = 0.0  # send time, relative to the benchmark's start
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def record_from_timeline(start: float, send: float, chunk_times: list[float], prompt_tokens: int,
                         output_tokens: int, text: str = "") -> RequestRecord:
    """Build a record from absolute timestamps: ``send`` and the arrival of each chunk that carries a choice."""
    if not chunk_times:
        return RequestRecord(start=start, error="no chunk with a choice was received")
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return RequestRecord(start=start, success=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                         ttft=chunk_times[0] - send, e2e=chunk_times[-1] - send, itl=itl, text=text)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES if p != 50}}
    arr = np.asarray(values) * scale
    out = {"mean": float(arr.mean()), "median": float(np.median(arr))}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES if p != 50})
    return out


def summarize(records: list[RequestRecord], duration: float, goodput: dict[str, float] | None = None) -> dict:
    """Aggregate per-request records; latencies in milliseconds, throughputs per second."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }
    if goodput:
        good = [r for r in ok if _meets(r, goodput)]
        summary["goodput"] = {"slo_ms": goodput, "requests": len(good),
                              "request_goodput": len(good) / duration if duration else 0.0}
    return summary


def _meets(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2e": record.e2e}
    return all(values[name] * 1000 <= limit for name, limit in slo_ms.items())


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not items:
        return None
    slo = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {item!r}")
        slo[name] = float(value)
    return slo


def records_as_dicts(records: list[RequestRecord]) -> list[dict]:
    return [{**asdict(r), "tpot": r.tpot} for r in records]
