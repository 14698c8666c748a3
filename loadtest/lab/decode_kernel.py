"""Benchmark of the paged decode kernel on a GPU: time per call, achieved GB/s and the fraction of the device's
measured read bandwidth, beside the torch path (gather by block table + SDPA) the CPU engine uses.

    python -m loadtest.lab.decode_kernel [--dtype bfloat16] [--block-size 16] [--save results.json]

Shapes (issue 3): batch {1, 8, 64} x context {512, 2k, 8k}, 32 query / 8 KV heads, head_dim 128.
Bytes counted are the K and V actually read: batch x context x kv_heads x head_dim x 2 x dtype size.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def measured_read_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large streaming read (a sum over 4 GiB), the ceiling a decode kernel can approach."""
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.float32, device=device).uniform_()
    ms = triton.testing.do_bench(lambda: x.sum(), warmup=5, rep=50)
    return x.numel() * 4 / (ms / 1000)


def bench_point(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, bs: int, dtype: torch.dtype,
                device: torch.device, peak: float) -> dict:
    import triton.testing

    from engine.attention import TorchAttention
    from kernels.decode_attention import choose_num_splits, decode_attention

    scale = head_dim**-0.5
    blocks_per_seq = context // bs
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(q)
    t_ms = triton.testing.do_bench(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out))
    torch_attn = TorchAttention(heads, kv_heads, head_dim, scale)
    r_ms = triton.testing.do_bench(lambda: torch_attn._decode(q, k_cache, v_cache, tables, lens))
    nbytes = batch * context * kv_heads * head_dim * 2 * dtype.itemsize
    return {"batch": batch, "context": context, "splits": choose_num_splits(batch, kv_heads, device),
            "triton_us": t_ms * 1e3, "triton_gbs": nbytes / t_ms / 1e6,
            "fraction_of_peak": nbytes / (t_ms / 1000) / peak, "torch_us": r_ms * 1e3, "torch_gbs": nbytes / r_ms / 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.lab.decode_kernel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("loadtest.lab.decode_kernel needs a CUDA GPU (a CPU runs the kernels only in the slow interpreter)")
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim, bs = 32, 8, 128, args.block_size
    peak = measured_read_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    print(f"{name}: measured read bandwidth {peak / 1e9:.0f} GB/s; {args.dtype}, block_size {bs}\n")
    print("| batch | context | splits | triton (us) | triton GB/s | % of read BW | torch (us) | torch GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for batch in (1, 8, 64):
        for context in (512, 2048, 8192):
            row = bench_point(batch, context, heads, kv_heads, head_dim, bs, dtype, device, peak)
            rows.append(row)
            print(f"| {batch} | {context} | {row['splits']} | {row['triton_us']:.1f} | {row['triton_gbs']:.0f} | "
                  f"{100 * row['fraction_of_peak']:.0f}% | {row['torch_us']:.1f} | {row['torch_gbs']:.0f} |")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"device": name, "read_bandwidth_gbs": peak / 1e9, "dtype": args.dtype, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
