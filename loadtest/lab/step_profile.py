"""Where one engine step's time goes, in-process: decode steps at a few batch sizes and one prefill step.

Each batch of requests (random 128-token prompts, greedy, ``ignore_eos``) is prefilled first; then
``--steps`` decode steps are timed as a whole and, per operation family, by timers wrapped around the C kernels
(``--attention-backend cpu``) or by the torch profiler's per-operator self time (``torch``; the fp32 matmuls of
that path run in numpy and show up in "other"). "other" is the rest of the step: Python, scheduling, input
preparation and sampling.

On the cpu backend a decode-only step runs every layer in one C call (``CpuBackend.decoder``), which the timers
cannot see into; its families are therefore measured over as many further steps through the per-module path
(the same kernels, one Python call each), whose own step time is printed beside them. A last table times, per
batch, a step that also carries a fresh prompt's first chunk, through that one C call and through the modules
(which run it with torch's SDPA), alternating. On CUDA the same tables set CUDA-graph replays against eager steps,
for decode steps and for those mixed steps.

    python -m loadtest.lab.step_profile                              # the default (cpu) path
    python -m loadtest.lab.step_profile --attention-backend torch    # the plain-torch path, for comparison
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from engine import LLM, SamplingParams
from engine.backends import cpu as cpu_backend
from engine.backends.greedy_head import MAX_ROWS
from kernels import cpu as cpu_kernels

_KERNELS = ("linear", "paged_decode_attention", "add_rms_norm", "rms_norm", "rotary_", "silu_mul", "store_kv",
            "linear_int8", "screened_argmax")


def _timed_kernels(totals: dict[str, float]) -> None:
    """Wraps the C kernels the model calls with timers adding into ``totals`` (seconds)."""

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            totals[name] += time.perf_counter() - start
            return result

        return timed

    for name in _KERNELS:
        setattr(cpu_kernels, name, wrap(name, getattr(cpu_kernels, name)))


def _measure(llm: LLM, steps: int, totals: dict[str, float], use_profiler: bool) -> tuple[float, float]:
    """Mean seconds per step over ``steps`` steps, and over the pass that filled ``totals`` with per-family
    seconds (a second pass, so neither the profiler nor the kernel timers weigh on the first figure)."""
    engine, backend = llm.engine, llm.engine.backend
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    totals.clear()
    if not use_profiler:
        decoder, backend.decoder = backend.decoder, None  # the per-module path, where the timers see
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        backend.decoder = decoder
        return elapsed / steps, (time.perf_counter() - start) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    for event in prof.key_averages():
        totals[event.key] += event.self_cpu_time_total / 1e6
    return elapsed / steps, elapsed / steps


def _head_ab(llm: LLM, steps: int) -> tuple[float, float]:
    """Mean seconds per decode step with the screened greedy head and with the full LM head, alternating step by
    step so both see the same machine."""
    engine, backend = llm.engine, llm.engine.backend
    head, times = backend.greedy_head, ([], [])
    for i in range(2 * steps):
        backend.greedy_head = head if i % 2 == 0 else None
        start = time.perf_counter()
        engine.step()
        times[i % 2].append(time.perf_counter() - start)
    backend.greedy_head = head
    return sum(times[0]) / steps, sum(times[1]) / steps


def _paths(llm: LLM) -> tuple[Callable[[bool], None], str, str] | None:
    """A switch between the engine's fast path for small steps and the one it replaces, with their names: the
    one-call C decoder or the modules (through ``DECODER_MAX_PREFILL_CONTEXT``), CUDA graphs or eager steps."""
    engine = llm.engine
    if getattr(engine.backend, "decoder", None) is not None:
        limit = cpu_backend.DECODER_MAX_PREFILL_CONTEXT

        def use_decoder(fast: bool) -> None:
            cpu_backend.DECODER_MAX_PREFILL_CONTEXT = limit if fast else 0

        return use_decoder, "C decoder", "modules"
    graphs = getattr(engine.backend, "graphs", None)
    if graphs is not None:

        def use_graphs(fast: bool) -> None:
            engine.backend.graphs = graphs if fast else None

        return use_graphs, "CUDA graphs", "eager"
    return None


def _decode_ab(llm: LLM, steps: int, use: Callable[[bool], None]) -> tuple[float, float]:
    """Median seconds per decode step through the fast path and the other one, alternating step by step (the
    median: an eager step may compile a Triton kernel for a shape the graphs never ran)."""
    times = ([], [])
    try:
        for i in range(2 * steps):
            use(i % 2 == 0)
            start = time.perf_counter()
            llm.engine.step()
            times[i % 2].append(time.perf_counter() - start)
    finally:
        use(True)
    return statistics.median(times[0]), statistics.median(times[1])


def _mixed_ab(llm: LLM, prompt_len: int, rounds: int, seed: int, use: Callable[[bool], None]) -> tuple[int, float,
                                                                                                      float]:
    """A step of the running batch's decodes plus a fresh prompt, through the fast path and the other one,
    alternating: (prompt tokens in the step, median seconds each)."""
    engine, vocab = llm.engine, llm.engine.vocab_size
    times, chunk = ([], []), 0
    one = SamplingParams(temperature=0, max_tokens=1)
    try:
        for i in range(2 * rounds):
            use(i % 2 == 0)
            rid = f"mixed-{seed}-{i}"  # a prompt of its own, so no prefix-cache hit shortens it
            engine.add_request(rid, [(5000 + 7919 * seed + 11 * i + 17 * j) % vocab for j in range(prompt_len)], one)
            start = time.perf_counter()
            engine.step()
            times[i % 2].append(time.perf_counter() - start)
            request = engine.scheduler.requests.get(rid)  # gone once its whole prompt ran (max_tokens 1)
            chunk = prompt_len if request is None else request.num_computed_tokens
            while rid in engine.scheduler.requests:
                engine.step()
    finally:
        use(True)
    return chunk, statistics.median(times[0]), statistics.median(times[1])


def _row(label: str, step_s: float, totals: dict[str, float], steps: int, top: int, split_s: float) -> str:
    """``split_s``: seconds per step of the pass ``totals`` come from."""
    parts = sorted(((k, v / steps * 1000) for k, v in totals.items()), key=lambda kv: -kv[1])[:top]
    other = split_s * 1000 - sum(v for _, v in parts)
    cells = ", ".join(f"{k} {v:.1f}" for k, v in parts)
    path = "" if split_s == step_s else f"per-module path {split_s * 1000:.1f}: "
    return f"| {label} | {step_s * 1000:.1f} | {path}{cells}, other {other:.1f} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.lab.step_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=7, help="operation families listed per row")
    parser.add_argument("--num-threads", type=int, default=None, help="the engine's torch threads")
    parser.add_argument("--quantized-matmul", default="exact", choices=["exact", "int8"], help="a GGUF file's products")
    parser.add_argument("--max-model-len", type=int, default=None, help="cap the context (a large model's pool)")
    parser.add_argument("--gemm-kernels", default="auto", choices=["auto", "c", "onednn"],
                        help="the products' family (auto: timed at start-up)")
    args = parser.parse_args(argv)

    llm = LLM(args.model, attention_backend=args.attention_backend, num_threads=args.num_threads, dtype=args.dtype,
              quantized_matmul=args.quantized_matmul, max_model_len=args.max_model_len,
              gemm_kernels=args.gemm_kernels)
    engine = llm.engine
    use_profiler = engine.backend.name != "cpu"
    totals: dict[str, float] = defaultdict(float)
    if not use_profiler:
        _timed_kernels(totals)
    print(f"backend {engine.backend.name}; ms per step; families: ms per step\n")
    print("| step | ms | where it goes (ms) |\n|---|---|---|")
    # Long enough to outlast the prefill of the whole batch; aborted once measured.
    greedy = SamplingParams(temperature=0, max_tokens=engine.max_model_len - args.prompt_len, ignore_eos=True)
    vocab = engine.vocab_size
    head_rows, decode_rows, mixed_rows = [], [], []
    paths = _paths(llm)
    for n, batch in enumerate(int(b) for b in args.batches.split(",")):
        for i in range(batch):
            ids = [(1000 + n * 7919 + i * 104729 + j * 31) % vocab for j in range(args.prompt_len)]
            engine.add_request(f"b{batch}-{i}", ids, greedy)
        running = engine.scheduler.running
        while engine.scheduler.waiting or any(r.num_computed_tokens < args.prompt_len for r in running):
            engine.step()
        engine.step()  # warm
        assert engine.scheduler.num_running == batch, "the batch must still be whole while it is measured"
        step_s, split_s = _measure(llm, args.steps, totals, use_profiler)
        print(_row(f"decode, batch {batch}", step_s, totals, args.steps, args.top, split_s))
        if getattr(engine.backend, "greedy_head", None) is not None and batch <= MAX_ROWS:
            screened, full = _head_ab(llm, args.steps)
            head_rows.append(f"| {batch} | {screened * 1000:.1f} | {full * 1000:.1f} |")
        if paths is not None:
            if getattr(engine.backend, "graphs", None) is not None:
                fast, other = _decode_ab(llm, args.steps, paths[0])
                decode_rows.append(f"| {batch} | {fast * 1000:.2f} | {other * 1000:.2f} |")
            if batch < engine.config.max_num_seqs:  # else the fresh prompt waits: no mixed step to time
                chunk, fast, other = _mixed_ab(llm, args.prompt_len, max(1, args.steps // 2), batch, paths[0])
                mixed_rows.append(f"| {batch} decodes + {chunk} prompt tokens | {fast * 1000:.2f} | "
                                  f"{other * 1000:.2f} |")
        engine.abort_requests([f"b{batch}-{i}" for i in range(batch)])
    one = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request("prefill-0", [(2000 + j) % vocab for j in range(args.prompt_len)], one)
    totals.clear()
    start = time.perf_counter()
    engine.step()
    step_s = split_s = time.perf_counter() - start
    # the families come from a second prompt of their own: through the profiler, or through the modules where the
    # timed step ran in one C call (prompts within DECODER_MAX_PREFILL_CONTEXT)
    engine.add_request("prefill-1", [(3000 + 7 * j) % vocab for j in range(args.prompt_len)], one)
    if use_profiler:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.step()
        for event in prof.key_averages():
            totals[event.key] += event.self_cpu_time_total / 1e6
    else:
        decoder, engine.backend.decoder = getattr(engine.backend, "decoder", None), None
        totals.clear()
        start = time.perf_counter()
        engine.step()
        split_s = time.perf_counter() - start
        engine.backend.decoder = decoder
    print(_row(f"prefill, {args.prompt_len} tokens", step_s, totals, 1, args.top, split_s))
    while engine.has_unfinished_requests():
        engine.step()
    if decode_rows:
        print(f"\nDecode steps through {paths[1]} or {paths[2]}, alternating (ms per step):\n")
        print(f"| batch | {paths[1]} | {paths[2]} |\n|---|---|---|")
        print("\n".join(decode_rows))
    if mixed_rows:
        print(f"\nA step of the running decodes plus a fresh prompt's first chunk, through {paths[1]} or {paths[2]},"
              " alternating (ms per step):\n")
        print(f"| step | {paths[1]} | {paths[2]} |\n|---|---|---|")
        print("\n".join(mixed_rows))
    if head_rows:
        print("\nGreedy tokens from the screened LM head or the full one, alternating step by step (ms per step):\n")
        print("| batch | screened head | full head |\n|---|---|---|")
        print("\n".join(head_rows))


if __name__ == "__main__":
    main()
