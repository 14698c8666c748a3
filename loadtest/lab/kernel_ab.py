"""Interleaved A/B timing of the CPU kernels (``kernels/cpu``) of two or more source revisions: a decode step's GEMMs
and its decode attention, at SmolLM2-135M's shapes.

The small cloud instances this runs on drift by tens of percent within minutes, so a change worth 5% only shows
when the variants run alternately, round by round, and are compared by their medians. As in a real step, every
layer has its own weights, which therefore stream from DRAM; the attention reads a pool through random block
tables, and a layer's worth of weights streams through the caches between two layers' calls, so its blocks come
from DRAM too.

    python -m loadtest.lab.kernel_ab HEAD~1 HEAD                       # a commit against its parent
    python -m loadtest.lab.kernel_ab HEAD "HEAD -DKC=256"               # the same source with a macro overridden
    python -m loadtest.lab.kernel_ab HEAD WORKTREE --rows 1,64 --context 192,1024
    python -m loadtest.lab.kernel_ab HEAD~1 HEAD --format q4 --rows 1,4 --context 192   # Q4 panels, as the default GGUF
    python -m loadtest.lab.kernel_ab HEAD --rows 1 --kv-dtype float32,bfloat16            # the pool's element types
    python -m loadtest.lab.kernel_ab HEAD~1 HEAD --format q4 --int8-activations --rows 1,64 --seqs 1  # int8 products
    python -m loadtest.lab.kernel_ab HEAD WORKTREE --format amx --rows 16,64,128 --seqs 1  # BF16A panels on AMX tiles
    python -m loadtest.lab.kernel_ab WORKTREE --format amx,q4a --rows 1,16,64 --seqs 1    # against Q4A panels
    python -m loadtest.lab.kernel_ab HEAD WORKTREE --shape llama-3.2-1b --format q4_k,q6_k --int8-activations \
        --rows 1,4,16 --seqs 1 --context 1                                                   # a GGUF file's K-quants
    python -m loadtest.lab.kernel_ab WORKTREE --shape llama-3.2-1b --format q4_k --int8-activations --rows 1 \
        --seqs 1 --context 1 --resident --threads 1     # compute-bound or memory-bound: from the caches and from DRAM
    python -m loadtest.lab.kernel_ab HEAD WORKTREE --shape llama-3.2-1b --format q4_ks,q6_ks --rows 1,16,64 \
        --seqs 1 --context 1                               # a Q4_K_M file's exact products on AMX tiles

A variant is a git revision (or ``WORKTREE``, the files on disk) and optional compiler flags after a space. With
``--format`` other than fp32 the weights are random values on that format's grid, packed once by the working tree's
code, so the variants must read the same layout; ``amx`` is bfloat16 weights in BF16A panels, every variant's
products on AMX tiles (a CPU with AMX only), ``q4a`` the projections as Q4 blocks in Q4A panels, ``q4s`` in Q4S
panels (fp32 on the tiles; its head as ``q4``'s). Several formats
(``--format amx,q4a``) are timed each with each variant, interleaved. ``--kv-dtype`` lists the K/V pool types to
time the attention with (each variant with each; revisions before bfloat16 pools read any pool as fp32, and before
int8 pools cannot read them: time int8 with revisions that have it). The formats named for GGUF block types
(``q4_k``, ``q5_k``, ``q6_k``, ``q8_0``) are random blocks of realistic scales (``loadtest.models``), the same for
every variant, each packed by that variant's own ``gguf_pack.c`` into the panels the engine packs a file's blocks
into, so revisions that lay those panels out differently compare too; ``q4_ks`` and ``q6_ks`` are Q4_K and Q6_K
blocks in the Q4KS and Q6KS panels a Q4_K_M file's products take in fp32 on AMX tiles (each variant's
``hp_pack_gguf_ksplit``). K-quants need ``--shape llama-3.2-1b`` (SmolLM2's 576 inputs are no whole super-block).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels import cdiv, kv_int8
from kernels.cpu import (
    BF16_DOTS,
    HP_Q8X,
    KV_FORMATS,
    WEIGHT_FORMATS,
    Body,
    as_split,
    pack_weight_bf16a,
    pack_weight_compact,
    pack_weight_q4a,
)
from kernels.cpu.formats import TILE_WIDTH, gguf_format
from kernels.cpu.library import ROOT as LIBRARY_ROOT
from kernels.cpu.library import build as build_library
from kernels.cpu.library import compile_library, declare, find_compiler
from loadtest.lab.compact_gemm import GRIDS
from loadtest.models import random_blocks

_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Shapes:
    """A model's shapes, SmolLM2-135M's by default: per layer fused q/k/v, o, fused gate/up and down projections;
    then the tied LM head."""

    hidden: int = 576
    intermediate: int = 1536
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    vocab: int = 49152
    layers: int = 30
    block_size: int = 16

    def linears(self) -> list[tuple[int, int]]:
        """(N, K) of each linear layer of one decoder layer."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return [(qkv, self.hidden), (self.hidden, self.heads * self.head_dim),
                (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)]


def build(variant: str, out_dir: Path) -> ctypes.CDLL:
    rev, _, flags = variant.partition(" ")
    if rev == "WORKTREE" and not flags.strip():  # the engine's own build of these files, cached by source and CPU
        return declare(ctypes.CDLL(str(build_library(find_compiler() or "cc"))))
    src = out_dir / f"src{len(list(out_dir.iterdir()))}"
    src.mkdir()
    if rev == "WORKTREE":
        shutil.copytree(LIBRARY_ROOT, src, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    else:  # that revision's C files, whatever their layout (kernels/cpu and any folders under it)
        archive = subprocess.run(["git", "archive", rev, LIBRARY_ROOT.relative_to(_ROOT).as_posix()], cwd=_ROOT,
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(src, filter="data")
        src = src / LIBRARY_ROOT.relative_to(_ROOT)
    lib = src / "ops.so"
    compile_library(find_compiler() or "cc", src, lib, tuple(flags.split()))
    return declare(ctypes.CDLL(str(lib)))


def amx_body(dll: ctypes.CDLL) -> int:
    """The bits of a product word that put a variant's bfloat16 products on AMX tiles: a revision before the body
    travelled with each call (ops.h's HP_BF16_BODY_AT) took it from a setter of the process, and needs none."""
    setter = getattr(dll, "hp_set_bf16_dot", None)
    if setter is not None:
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        setter(BF16_DOTS["amx"])
        return 0
    return Body(bf16="amx").word()


SHAPES = {"smollm2-135m": Shapes(),
          "llama-3.2-1b": Shapes(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256,
                                 layers=16)}
BLOCK_TYPES = {"q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K,
               "q6_k": GGMLQuantizationType.Q6_K, "q8_0": GGMLQuantizationType.Q8_0}
KSPLIT_TYPES = {"q4_ks": GGMLQuantizationType.Q4_K, "q6_ks": GGMLQuantizationType.Q6_K}  # fp32 on AMX tiles
TILE_FORMATS = {"amx", "q4a", "q4s", *KSPLIT_TYPES}
FORMATS = ("fp32", "amx", "q4a", "q4s", *sorted(GRIDS), *BLOCK_TYPES, *KSPLIT_TYPES)


def step_weights(fmt: str, shapes: list[tuple[int, int]], gen: torch.Generator,
                 dll: ctypes.CDLL | None = None) -> list[tuple[torch.Tensor, int, int]]:
    """A step's weights packed as ``fmt``'s panels: fp32 by ``dll``'s own packing (revisions may differ), the others
    but GGUF blocks (``block_step_weights``) by the working tree's. q4a: the projections as Q4 blocks in Q4A panels,
    the LM head (the last shape) in BF16A, as the engine packs the default GGUF in bfloat16 on AMX. q4s: the same
    blocks as Q4S panels (fp32 on AMX tiles), the head as q4's."""
    out = []
    for i, (n, k) in enumerate(shapes):
        if fmt == "fp32":
            weight = packed(dll, torch.randn(n, k, generator=gen) * k**-0.5)
        elif fmt in ("q4a", "q4s") and i < len(shapes) - 1:
            q = torch.randint(0, 16, (n, k // 32, 32), generator=gen, dtype=torch.uint8)
            d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half().float()
            weight = pack_weight_q4a(q, d, -8 * d)
            weight = as_split(weight) if fmt == "q4s" else weight
        elif fmt == "q4s":  # the head as --format q4's, so the two differ in the projections alone
            weight = pack_weight_compact(GRIDS["q4"][0](n, k, gen))
        elif fmt in ("amx", "q4a"):
            weight = pack_weight_bf16a(GRIDS["bf16"][0](n, k, gen))
        else:
            make, dtype = GRIDS[fmt]
            weight = pack_weight_compact(make(n, k, gen))
            assert weight.dtype == dtype, f"{fmt} weight packed as {weight.dtype}"
        out.append((weight, n, k))
    return out


def block_step_weights(fmt: str, shapes: list[tuple[int, int]], gen: torch.Generator,
                       dlls: list[ctypes.CDLL]) -> list[list[tuple[torch.Tensor, int, int]]]:
    """Per variant, a step's weights as random GGUF blocks of ``fmt`` (the same blocks for all), each packed by that
    variant's own ``hp_pack_gguf`` into the panels the engine packs a file's blocks into (``hp_pack_gguf_ksplit``'s
    Q4KS or Q6KS panels for ``q4_ks`` and ``q6_ks``)."""
    kind = KSPLIT_TYPES.get(fmt) or BLOCK_TYPES[fmt]
    out: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in dlls]
    for n, k in shapes:
        seed = int(torch.randint(2**31, (1,), generator=gen))
        blocks = torch.from_numpy(random_blocks(np.random.default_rng(seed), n, k, kind))
        rows = blocks.data_ptr() + blocks.stride(0) * torch.arange(n, dtype=torch.int64)
        for dll, weights in zip(dlls, out, strict=True):
            if fmt in KSPLIT_TYPES:
                fmt = gguf_format(int(kind), "tiles-fp32")
                buffer = torch.empty(cdiv(n, TILE_WIDTH) * k // fmt.inputs * fmt.block_bytes(TILE_WIDTH),
                                     dtype=torch.uint8)
                if dll.hp_pack_gguf_ksplit(int(kind), rows.data_ptr(), n, k, buffer.data_ptr()) != buffer.numel():
                    raise ValueError(f"{fmt}: a variant's gguf_pack.c does not pack {kind.name} into K-quant panels")
                weights.append((buffer.view(fmt.tag), n, k))
                continue
            width = dll.hp_panel_width()
            buffer = torch.empty(cdiv(n, width) * width * k * 3 // 2, dtype=torch.uint8)  # panels: <= 1.125 B a weight
            written = dll.hp_pack_gguf(int(kind), rows.data_ptr(), n, k, width, buffer.data_ptr())
            if written < 0:
                raise ValueError(f"{fmt}: a variant's gguf_pack.c does not pack {kind.name}")
            weights.append((buffer[:written].clone().view(gguf_format(int(kind), "exact").tag), n, k))
    return out


def packed(dll: ctypes.CDLL, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    width = dll.hp_panel_width()
    out = torch.empty((n + width - 1) // width * width * k)
    dll.hp_pack_weight(w.data_ptr(), out.data_ptr(), n, k)
    return out


def gemm_round(dll: ctypes.CDLL, weights: list[tuple[torch.Tensor, int, int]], x: torch.Tensor, y: torch.Tensor,
               rows: int, flags: int = 0) -> float:
    start = time.perf_counter()
    for w, n, k in weights:
        dll.hp_linear_packed(WEIGHT_FORMATS[w.dtype] | flags, x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n,
                             rows, n, k)
    return time.perf_counter() - start


@dataclass
class Pool:
    """Per layer its own K and V pool; every sequence `context` positions long, its blocks drawn at random."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    tables: torch.Tensor
    seq_lens: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    stream: torch.Tensor  # a layer's weights, read between two layers' calls

    @classmethod
    def make(cls, s: Shapes, seqs: int, context: int, gen: torch.Generator, kv_dtype: torch.dtype,
             prompt: tuple[int, int] = (0, 0)) -> Pool:
        """``seqs`` decodes of ``context`` positions, then ``prompt`` = (tokens, start): one more sequence's prompt
        chunk, its tokens at positions start .. start + tokens - 1, each a query over its prefix, as the one-call
        decoder sends a step's prompt tokens (each with its request's block table)."""
        tokens, start = prompt
        per_seq = max(cdiv(context, s.block_size), cdiv(start + tokens, s.block_size))
        blocks = (seqs + (tokens > 0)) * per_seq
        shape = (blocks, s.block_size, s.kv_heads, s.head_dim)
        k = [kv_int8.to_pool(torch.randn(shape, generator=gen), kv_dtype) for _ in range(s.layers)]
        v = [kv_int8.to_pool(torch.randn(shape, generator=gen), kv_dtype) for _ in range(s.layers)]
        tables = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(-1, per_seq)
        tables = torch.cat([tables[:seqs], tables[seqs:].expand(tokens, per_seq)])
        seq_lens = torch.cat([torch.full((seqs,), context, dtype=torch.int32),
                              torch.arange(start + 1, start + tokens + 1, dtype=torch.int32)])
        q = torch.randn(seqs + tokens, s.heads * s.head_dim, generator=gen)
        layer_floats = sum(n * k for n, k in s.linears())
        return cls(k, v, tables.contiguous(), seq_lens, q, torch.empty_like(q), torch.ones(layer_floats))

    def attention_round(self, dll: ctypes.CDLL, s: Shapes) -> float:
        spent = 0.0
        seqs, width = self.q.shape
        for layer in range(s.layers):
            self.stream.sum()
            start = time.perf_counter()
            dll.hp_paged_decode_attention(
                self.q.data_ptr(), width, self.k[layer].data_ptr(), self.v[layer].data_ptr(), self.tables.data_ptr(),
                self.tables.shape[1], self.seq_lens.data_ptr(), self.out.data_ptr(), width, seqs, s.heads,
                s.kv_heads, s.head_dim, s.block_size, s.head_dim**-0.5, KV_FORMATS[self.k[layer].dtype])
            spent += time.perf_counter() - start
        return spent


def interleave(runs: list[Callable[[], float]], rounds: int) -> list[list[float]]:
    """Seconds of each variant's run, round by round, the variants alternating. NOTE: whichever variant ran first in
    a round read 5-20% slow on a Xeon with AMX (two variants swapped their places when their order was swapped), so
    each round starts one variant later than the round before: every variant leads as often as the others."""
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i in range(len(runs)):
            j = (r + i) % len(runs)
            times[j].append(runs[j]())
    return times


def report(title: str, variants: list[str], times: list[list[float]], flop: float | None = None) -> None:
    base = statistics.median(times[0])
    print(f"\n{title}")
    print("| variant | median ms | min ms | vs first |" + (" GFLOP/s |" if flop else ""))
    print("|---|---|---|---|" + ("---|" if flop else ""))
    for v, t in zip(variants, times, strict=True):
        med = statistics.median(t)
        rate = f" {flop / med / 1e9:.0f} |" if flop else ""
        print(f"| {v} | {med * 1e3:.2f} | {min(t) * 1e3:.2f} | {med / base:.3f} |{rate}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help='git revision or WORKTREE, then any compiler flags: "HEAD -DKC=256"')
    p.add_argument("--rows", default="1,8,64,256", help="GEMM rows (tokens in the step)")
    p.add_argument("--seqs", default="1,4,16,64", help="decode sequences for the attention")
    p.add_argument("--context", default="192,1024", help="context lengths for the attention")
    p.add_argument("--prompt", default="0@0", metavar="TOKENS@START",
                   help="the attention's step also carries a prompt chunk: TOKENS queries of one more sequence at "
                        "positions START onwards (as a step that prefills beside its decodes)")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--format", default="fp32", help=f"the weights' panels, one or more of {', '.join(FORMATS)}")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="the model whose step is timed")
    p.add_argument("--kv-dtype", default="float32", help="K/V pool types for the attention: float32, bfloat16, int8")
    p.add_argument("--int8-activations", action="store_true",
                   help="block panels (--format q4, q8, q4_k, ...) multiply activations rounded to int8 "
                        "(--quantized-matmul int8)")
    p.add_argument("--resident", action="store_true",
                   help="also time one layer's products, each as many times in a row as there are layers, so its "
                        "weights stay in the caches: the rate the kernels compute at, beside the step's from DRAM")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    formats = args.format.split(",")
    if set(formats) - set(FORMATS):
        p.error(f"--format: unknown {', '.join(sorted(set(formats) - set(FORMATS)))}; known: {', '.join(FORMATS)}")
    s = SHAPES[args.shape]
    super_block = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][0]
    k_quants = [f for f in formats if f.endswith(("_k", "_ks"))]
    if k_quants and any(k % super_block for _, k in s.linears()):
        p.error(f"--format {', '.join(k_quants)}: {args.shape}'s inputs are no whole super-blocks; take --shape "
                "llama-3.2-1b")
    known = {str(dtype).removeprefix("torch."): dtype for dtype in KV_FORMATS}
    kv_names = args.kv_dtype.split(",")
    tokens, _, start = args.prompt.partition("@")
    if not (tokens.isdigit() and start.isdigit()):
        p.error(f"--prompt: TOKENS@START, two counts, got {args.prompt!r}")
    prompt = (int(tokens), int(start))
    unknown = set(kv_names) - set(known)
    if unknown:
        p.error(f"--kv-dtype: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    torch.set_num_threads(args.threads)  # the kernels' OpenMP too: torch loads the libgomp.so.1 they link
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        dlls = [build(v, Path(tmp)) for v in args.variants]
        tiles = bool(TILE_FORMATS & set(formats))
        if tiles and not all(d.hp_bf16_dots() & 1 << BF16_DOTS["amx"] for d in dlls):
            p.error(f"--format {', '.join(sorted(TILE_FORMATS))}: this CPU (or a variant) has no AMX tiles")
        bodies = [amx_body(d) if tiles else 0 for d in dlls]  # each variant's products on the tiles
        shapes = [shape for _ in range(s.layers) for shape in s.linears()] + [(s.vocab, s.hidden)]
        # per format, per variant: every layer its own weights, so a step streams them from DRAM, as a real one does
        packs = {f: [step_weights(f, shapes, gen, d) for d in dlls] if f == "fp32"
                 else block_step_weights(f, shapes, gen, dlls) if f in BLOCK_TYPES or f in KSPLIT_TYPES
                 else [step_weights(f, shapes, gen)] * len(dlls) for f in formats}
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, max(k for _, k in s.linears()), generator=gen)
            y = torch.empty(rows, s.vocab)
            flop = sum(2.0 * rows * n * k for n, k in shapes)
            flags = HP_Q8X if args.int8_activations else 0
            names = [f"{v} ({f} panels)" if len(formats) > 1 else v for f in formats for v in args.variants]
            kind = f"{', '.join(formats)} panels" + (", int8 activations" if flags else "")
            for resident in (False, True) if args.resident else (False,):
                # resident: each of the first layer's weights as many times in a row as there are layers (it stays
                # in the caches where it fits: the largest of a 1B layer, 20-28 MB of K-quants, in a 32 MiB L3)
                steps = [[w for w in pk[:len(s.linears())] for _ in range(s.layers)] if resident else pk
                         for f in formats for pk in packs[f]]
                runs = [partial(gemm_round, d, pk, x, y, rows, flags | body)
                        for d, pk, body in zip(dlls * len(formats), steps, bodies * len(formats), strict=True)]
                what = (f"{s.layers} layers of one layer's weights, each {s.layers} times in a row" if resident
                        else f"{s.layers} layers and the LM head")
                work = sum(2.0 * rows * n * k for _, n, k in steps[0]) if resident else flop
                report(f"GEMMs of one step ({what}, {kind}), {rows} rows, {args.threads} threads", names,
                       interleave(runs, args.rounds), work)
        for context in map(int, args.context.split(",")):
            for seqs in map(int, args.seqs.split(",")):
                pools = [Pool.make(s, seqs, context, gen, known[name], prompt) for name in kv_names]
                runs = [partial(pool.attention_round, d, s) for pool in pools for d in dlls]
                names = [f"{v} ({name} pool)" if len(kv_names) > 1 else v for name in kv_names for v in args.variants]
                times = interleave(runs, args.rounds)
                chunk = f", and a prompt chunk of {prompt[0]} tokens from position {prompt[1]}" if prompt[0] else ""
                report(f"decode attention of one step ({s.layers} layers), {seqs} sequences x {context} positions"
                       f"{chunk}", names, times)
                del pools


if __name__ == "__main__":
    main()
