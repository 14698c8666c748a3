"""Engine options on a command line: the fields of ``EngineConfig`` as ``--kebab-case`` flags, so ``harpoon serve``,
``harpoon generate``, the benchmarks and ``LLM(**kwargs)`` share one vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from engine.config import EngineConfig

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "KIB": 2**10,
    "KI": 2**10,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "MI": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
    "GI": 2**30,
    "T": 10**12,
    "TB": 10**12,
    "TIB": 2**40,
    "TI": 2**40,
}


def parse_memory(text: str) -> int | float:
    """``0.8`` -> a fraction of free memory; ``2147483648``, ``2GiB``, ``512MB`` -> bytes."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 2GiB) or a fraction in (0, 1], got {text!r}")
    number, unit = match.group(1), (match.group(2) or "").upper()
    if "." in number and not unit:
        return float(number)
    return int(float(number) * _UNITS[unit])


_HELP = {
    "max_num_seqs": "most requests in the running batch",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes); on CPU the default is "
                              "sized at start-up for ~0.6 s steps",
    "prefill_tokens_per_decode": "prompt tokens a step may carry per decode in it or request waiting to start, at "
    "least a block, a CPU step's fixed cost (timed at start-up) counting as decodes too (keeps running streams' "
    "inter-token gaps short while prompts arrive); default 2 on a CPU, no cap on a GPU; 0: no cap",
    "max_model_len": "longest prompt + output (default: the model's)",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory": "KV pool size: bytes (2GiB, 512MB) or a fraction of free memory (0.8)",
    "dtype": "auto (bf16 on CUDA; on a CPU bf16 for a bf16 checkpoint where bf16 products measure faster, else fp32), "
    "float32, float16, bfloat16",
    "kv_cache_dtype": "auto (the model's dtype: exact), bfloat16 (twice the cached tokens in the same memory, but "
    "greedy tokens may differ from the exact pool's), int8 (CPU only: 3.8x fp32's tokens, each value rounded to 1/254 "
    "of its row's largest; tokens part from the exact pool's sooner)",
    "device": "auto, cpu, cuda, cuda:1, ...",
    "attention_backend": "auto (triton on CUDA, cpu for fp32 on a CPU with a C compiler, else torch), cpu, torch, "
    "triton",
    "seed": "seed of the engine's random state (requests may carry their own)",
    "num_threads": "torch intra-op threads (default: torch's choice)",
    "quantized_matmul": "a GGUF file's products on a CPU: auto (the default: int8 where the CPU has integer dot "
    "products, else exact), exact (the bits of its dequantized weights' products: greedy tokens equal "
    "transformers') or int8 (activations rounded to int8 per 32 inputs with integer dot products, as llama.cpp: "
    "faster, logprobs differ slightly)",
    "tensor_parallel_size": "split every layer over N ranks, one process each (on a CPU the cores are shared out "
    "between them; on CUDA one GPU each); the model's heads, KV heads and MLP width must divide evenly",
    "gemm_kernels": "CPU products: auto (the faster family, timed at start-up), c (Harpoon's panels) or onednn, "
                    "untimed",
    "speculative_config": "n-gram speculative decoding for greedy requests, as JSON: "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
    '"disable_by_batch_size": 4}\' (the keys are optional; these are the defaults); off by default',
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for field in dataclasses.fields(EngineConfig):
        if field.name in ("model", "enable_prefix_caching", "enforce_eager", "panel_cache", "fp32_panels"):
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = parse_memory if field.name == "kv_cache_memory" else (
            str if field.type == "str" or field.name == "speculative_config"  # JSON text, parsed by EngineConfig
            else float if field.type.startswith("float") else int)
        group.add_argument(flag, dest=field.name, type=kind, default=None, help=_HELP.get(field.name))
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="do not share cached prompt blocks between requests",
    )
    group.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_true",
        default=None,
        help="on CUDA, run every step eagerly instead of replaying CUDA graphs (no capture at start-up)",
    )
    group.add_argument(
        "--no-panel-cache",
        dest="panel_cache",
        action="store_false",
        default=None,
        help="on a CPU, pack a GGUF file's weights at every start instead of mapping the panels an earlier start "
        "kept in $HARPOON_CACHE/panels (as large as the file)",
    )
    group.add_argument(
        "--no-fp32-panels",
        dest="fp32_panels",
        action="store_false",
        default=None,
        help="on a CPU in fp32, do not keep a small model's fp32 panels (up to 1 GiB) beside its Q4/Q8/BF16 ones: "
        "less memory, slower steps of many rows",
    )


def engine_args_from(namespace: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The engine options given on the command line, checked now: a bad value is the parser's usage error, before
    a model is resolved or loaded."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    args = {k: v for k, v in vars(namespace).items() if k in names and v is not None}
    try:
        EngineConfig.from_kwargs(**args)
    except ValueError as e:
        parser.error(str(e))
    return args


def parse_engine_args(flags: list[str]) -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    return engine_args_from(parser.parse_args(flags), parser)
