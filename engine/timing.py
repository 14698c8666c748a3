"""How start-up times a call on a machine that drifts: the calls a candidate runs to fill a small budget, and
candidates that take turns, each keeping its best (``engine/kernel_plan.py``, ``engine/backends``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def seconds_per_call(fn: Callable[[], object], budget_s: float = 0.01, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean time of ``fn`` over enough calls to fill ``budget_s``. A call that alone
    fills the budget is one round (the first, which sized the rounds, counts): an 8B model's start-up timed its
    layers' products in five calls each, 1.3 s of its load."""
    fn()
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    reps = max(1, int(budget_s / max(first, 1e-6)))
    times = [first] if reps == 1 else []
    while len(times) < rounds:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def best_in_turns(fns: dict[str, Callable[[], object]], turns: int = 2, budget_s: float = 0.01) -> dict[str, float]:
    """Each of ``fns``' best mean time a call over the calls that size its turns (after one to warm it) and
    ``turns`` turns in which they take turns, each turn enough calls to fill ``budget_s``. Why turns: a choice
    between two bodies timed one after the other, all of one and then all of the other, went to the slower where
    the machine was slow for a moment (a 1B Q4_K_M's tiles read 146 ms against 94-100 at other starts, and that
    server kept the FMAs, 1.8x the time a token)."""
    reps, best = {}, {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        fn()
        best[name] = time.perf_counter() - start
        reps[name] = max(1, int(budget_s / max(best[name], 1e-6)))
    for _ in range(turns):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps[name])
    return best
