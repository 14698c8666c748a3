"""What an engine tunes and warms up before its first request, by serving made-up prompts through itself.

The engine runs these (``EngineCore._warm_up``); the backend only answers what it needs
(``TorchBackend.sizes_token_budget``, ``TorchBackend.warm_up_down_to``). Each function takes the engine's
``serve_made_up_prompts`` and the numbers it sizes from, and returns what it found: it never reaches into the engine.

- On a CPU, the step's token budget is sized to the machine (``size_cpu_token_budget``). Past a few dozen tokens a
  step is compute-bound, so its time is close to tokens x the cost of one, and it is the gap every running stream
  waits between two tokens. Instances of one machine kind differ 2x in that cost.
- On a GPU, the eager paths are compiled and loaded (``warm_up_bursts``): a step too big for a CUDA graph (a burst
  of new prompts) runs eagerly, and the first of its size compiles the Triton prefill kernel and loads the GEMM
  kernels for its shapes. On an H100 the first 16-prompt burst took 740 ms, against 29 ms the second time, and still
  423 ms with Triton's disk cache warm.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from engine.kernel_plan import PlanRow
from kernels import cdiv

logger = logging.getLogger(__name__)

# Steps of ~0.6 s: with 64 streams decoding beside prefill chunks, the 99th percentile gap between two tokens ran
# 1.3-1.4x the step's time, so this keeps it under 1 s while a step stays big enough for throughput (384 tokens at
# 1.55 ms a token). With the per-decode prompt cap, the whole budget is reached by steps with nothing to decode (a
# burst) or with ~a quarter of it decoding.
CPU_STEP_TARGET_S = 0.6
MIN_CPU_TOKEN_BUDGET, MAX_CPU_TOKEN_BUDGET = 128, 1024
BUDGET_PROBE_TOKENS, BUDGET_PROBES = 256, 5
# A first look with a short step: where even it shows the smallest budget (by a margin over what a short step's
# lower efficiency could explain), the long probes are skipped. Why: an 8B model's 256-token step takes ~40 s on the
# 2-core machines, and five of them kept it from serving for over 3 minutes, to find the smallest budget anyway.
# NOTE: 8 tokens, not 32: the 8B's 32-token look alone took 4-5 s of its start. An 8-token step cost 1.7x a long
# step's time per token on the default model and 1.5x on a 1B Q4_K_M (32 tokens: 1.1x and 1.2x; AVX2 EPYC), so
# the margin of 2 the 32-token look had over 1.2x is kept over 1.7x.
SHORT_PROBE_TOKENS, SHORT_PROBE_MARGIN = 8, 3.0
WARM_UP_PROMPT_LEN, WARM_UP_EARLY_PROMPTS = 128, 3


def cpu_token_budget(seconds_per_token: float, block_size: int = 16) -> int:
    """The most tokens a step of about CPU_STEP_TARGET_S holds, in whole blocks, within the bounds above."""
    budget = int(CPU_STEP_TARGET_S / seconds_per_token) // block_size * block_size
    return max(MIN_CPU_TOKEN_BUDGET, min(MAX_CPU_TOKEN_BUDGET, budget))


def long_probe_tokens(short_per_token: float, most: int, block_size: int = 16) -> int:
    """The long probes' length: a step of about CPU_STEP_TARGET_S at the short probe's cost per token, in whole
    blocks, at least half the smallest budget and at most ``most``. A short step's tokens cost more than a long one's
    (1.5-2x), so this is at most the budget the long probes then find, and a step's cost per token is flat from ~64
    tokens on (a 1B bf16: 5.23 ms a token at 64, 128 and 256 tokens; the default model 1.17, 1.13 and 1.17). Why:
    five 256-token probes took 6.7 s of that 1B's start (a 1B Q4_K_M's 6 s) to find the smallest budget, where
    80-token ones take 2 s; the default model (2.3 ms a token at 8) still probes with 256."""
    tokens = cdiv(int(CPU_STEP_TARGET_S / short_per_token), block_size) * block_size
    return max(MIN_CPU_TOKEN_BUDGET // 2, min(most, tokens))


def fixed_tokens(one: float, many: float, n: int) -> float:
    """A step's fixed cost in tokens' worth, a / b of t(n) = a + b n, from the seconds a step of one token and one
    of ``n`` tokens took (0 where the two do not show one)."""
    per_token = (many - one) / (n - 1)
    return max(0.0, (one - per_token) / per_token) if per_token > 0 else 0.0


class MadeUpPrompts(Protocol):
    """``EngineCore.serve_made_up_prompts``: serve made-up prompts to their first token; the seconds it took."""

    def __call__(self, key: int, num_prompts: int, length: int, sampled: bool = False,
                 num_early: int = 0) -> float: ...


@dataclass(frozen=True)
class TokenBudget:
    """A CPU step's token budget as start-up timed it, and a step's fixed cost in tokens' worth
    (``Scheduler.step_fixed_tokens``), with what they were sized from: a prefill step of ``probe_tokens`` tokens at
    ``seconds_per_token``."""

    max_num_batched_tokens: int
    step_fixed_tokens: float
    probe_tokens: int = 0
    seconds_per_token: float = 0.0

    def row(self) -> PlanRow:
        """The budget as a row of the engine's plan."""
        return PlanRow("step token budget", str(self.max_num_batched_tokens),
                       {f"a token of {self.probe_tokens}": self.seconds_per_token},
                       f"prefill steps, a step of ~{CPU_STEP_TARGET_S} s",
                       f"fixed cost {self.step_fixed_tokens:.1f} tokens")


def probe_room(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The longest probe the context and the pool hold, up to BUDGET_PROBE_TOKENS."""
    return min(BUDGET_PROBE_TOKENS, max_model_len - 1, (num_blocks - 1) * block_size)


def size_cpu_token_budget(serve: MadeUpPrompts, room: int, block_size: int) -> TokenBudget | None:
    """Time a few prefill steps (none longer than ``room`` tokens), then the budget so a full step takes about
    CPU_STEP_TARGET_S, and a step's fixed cost (``Scheduler.prefill_budget``); None where a toy pool or context
    leaves no room to time in. Measured once: from then on the scheduling is deterministic (max_num_batched_tokens
    and prefill_tokens_per_decode fix it across machines too)."""
    n = room
    if n < MIN_CPU_TOKEN_BUDGET // 2:
        return None
    # The first step pays one-off costs (page faults, thread start-up); the fastest of the rest is the machine's
    # speed, the others caught it busy with something else. A one-token step pays them as well as a longer one: the
    # 32-token steps after it took the same time as later ones (default model and an 8B Q4_K_M), and on the 8B it
    # takes 0.26 s where a 32-token step takes 1.5 s.
    # The fixed cost is timed only where the long probes run: where even short steps show the smallest budget (a
    # large model), a step is far from its fixed cost (the 8B: ~5 tokens' worth) and two more probes would cost
    # ~0.5 s of its start.
    serve(BUDGET_PROBES, 1, 1)
    short = serve(BUDGET_PROBES + 1, 1, SHORT_PROBE_TOKENS) / SHORT_PROBE_TOKENS
    fixed = 0.0
    if short >= SHORT_PROBE_MARGIN * CPU_STEP_TARGET_S / MIN_CPU_TOKEN_BUDGET:
        n, per_token = SHORT_PROBE_TOKENS, short
    else:
        n = long_probe_tokens(short, n, block_size)
        timings = [serve(i, 1, n) for i in range(BUDGET_PROBES)]
        per_token = min(timings[1:]) / n
        one = min(serve(BUDGET_PROBES + 2 + i, 1, 1) for i in range(2))
        fixed = fixed_tokens(one, per_token * n, n)
    budget = cpu_token_budget(per_token, block_size)
    logger.info("token budget %d per step (a prefill step of %d tokens took %.1f ms: %.2f ms per token); a step's "
                "fixed cost %.1f tokens' worth", budget, n, per_token * n * 1000, per_token * 1000, fixed)
    return TokenBudget(budget, fixed, n, per_token)


def burst_room(max_num_seqs: int, num_blocks: int, block_size: int, max_model_len: int) -> tuple[int, int]:
    """(the most prompts a warm-up burst holds, their length): WARM_UP_PROMPT_LEN tokens, or what the context holds,
    as many as the pool holds at once (a block to spare) up to ``max_num_seqs``."""
    length = min(WARM_UP_PROMPT_LEN, max_model_len - 2)
    return min(max_num_seqs, num_blocks // cdiv(length + 2, block_size) - 1), length


def warm_up_bursts(serve: MadeUpPrompts, budget: int, most: int, length: int, smallest: int) -> None:
    """Bursts of the whole token ``budget``, then half of it and so on down to ``smallest`` tokens (the largest step
    a graph replays), each prompt ``length`` tokens and at most ``most`` prompts a burst; the first prompt of each is
    sampled. A last burst comes as a first wave of users does, a few prompts a step ahead of the rest, so its second
    step mixes their decodes into the prompts."""
    started = time.monotonic()
    tokens, bursts = budget, 0
    while tokens > smallest and most > WARM_UP_EARLY_PROMPTS:
        serve(bursts, min(most, max(1, tokens // length)), length, sampled=True)
        tokens, bursts = tokens // 2, bursts + 1
    if bursts:
        serve(bursts, min(most, budget // length + WARM_UP_EARLY_PROMPTS), length, num_early=WARM_UP_EARLY_PROMPTS)
        logger.info("warmed up with %d bursts of prompts in %.1f s", bursts + 1, time.monotonic() - started)
