"""GFLOP/s of every candidate for a linear layer's product on this machine, at the batch sizes a step has: Harpoon's
C panels (fp32, and BF16C computed in bfloat16: avx512_bf16, the portable FMAs, AMX tiles and AMX's BF16A panels,
where the CPU has them), torch's ``F.linear`` and oneDNN with prepacked weights (fp32 and bf16), on a model's
projection shapes; then the machine's matmul peak per dtype. It is the table behind ``engine/backends/gemm_plan.py``,
which runs a smaller version of it at every start.

    python -m loadtest.lab.gemm                       # SmolLM2-135M's shapes
    python -m loadtest.lab.gemm --shapes 4096x4096,28672x4096 --rows 1,16,64
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from engine.backends.gemm_plan import cpu_isa, library_available, matmul_peak_gflops
from engine.timing import seconds_per_call
from kernels import cpu

SMOLLM2 = "960x576,576x576,3072x576,576x1536,49152x576"  # qkv, o, gate_up, down, head: N x K


def candidates(weight: torch.Tensor) -> dict[str, object]:
    """name -> (x fp32 [M, K]) -> y, each with its weight prepared once, as a server would. The C bfloat16
    products run through each body the CPU has (avx512_bf16's dot product, its portable FMAs, AMX tiles), and on
    AMX also from the 32-column BF16A panels the engine packs there."""
    n = weight.shape[0]
    fp32, bf16c, wb = cpu.pack_weight(weight), cpu.pack_weight_bf16c(weight), weight.bfloat16()
    out = {"C fp32": lambda x: cpu.linear(x, fp32, n)}
    names = {"dpbf16": "C bf16", "fma": "C bf16 portable", "amx": "C bf16 AMX"}
    for body in sorted(cpu.bf16_dots(), key=list(names).index):
        out[names[body]] = lambda x, body=body: _through(body, bf16c, x, n)
    if "amx" in cpu.bf16_dots():  # BF16C where K is not a multiple of 32, as the engine packs it
        bf16a = cpu.pack_weight_bf16a(weight) if weight.shape[1] % 32 == 0 else bf16c
        out["C BF16A AMX"] = lambda x: _through("amx", bf16a, x, n)
    out["F.linear fp32"] = lambda x: F.linear(x, weight)
    out["F.linear bf16"] = lambda x: F.linear(x.bfloat16(), wb)
    if library_available():
        p32 = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out["oneDNN fp32"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, p32, None, "none", [], "")
    if library_available(torch.bfloat16):
        pbf = torch.ops.mkldnn._reorder_linear_weight(wb, None)
        out["oneDNN bf16"] = lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), pbf, None, "none", [], "")
    return out


def _through(body: str, packed: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    return cpu.linear(x, packed, n, body=cpu.Body(bf16=body))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SMOLLM2, help="N x K of each weight, comma-separated")
    p.add_argument("--rows", default="1,4,16,64,256", help="batch sizes M")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(m) for m in args.rows.split(",")]
    print(f"ISA: {cpu_isa()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"C bf16 bodies: {', '.join(cpu.bf16_dots())}")
    torch.manual_seed(0)
    header = None
    for n, k in shapes:
        weight = torch.randn(n, k) / k**0.5
        kernels = candidates(weight)
        if header is None:
            header = ["shape", "M", *kernels]
            print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for m in rows:
            x = torch.randn(m, k)
            rates = [2 * m * n * k / seconds_per_call(lambda f=f, x=x: f(x)) / 1e9 for f in kernels.values()]
            print(f"| {n}x{k} | {m} | " + " | ".join(f"{r:.3g}" for r in rates) + " |", flush=True)
    print("\nGFLOP/s. Machine matmul peak (torch, [up to 1024, 2048] x [2048, 2048]): "
          + ", ".join(f"{d}: {matmul_peak_gflops(getattr(torch, d)):.0f}" for d in ("float32", "bfloat16")))


if __name__ == "__main__":
    main()
