"""Harpoon's engine: paged KV cache, continuous batching scheduler, model runner and sampler."""

import os
import sys

# NOTE: OpenMP reads this once, when torch loads; see engine/models/linear.py for why it matters (5x on decode
# GEMMs). If torch was loaded first without it, linear.py keeps to torch's own BLAS instead.
# GOMP_SPINCOUNT: with PASSIVE alone an idle OpenMP thread sleeps at once, and waking it for each of a decode
# step's ~330 parallel kernels cost ~2-3 ms of a 27 ms step at batch 1 (measured, SmolLM2-135M, 2 cores); spinning
# ~10k iterations (tens of microseconds) bridges the gaps between kernels and still frees the core between steps.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from engine.llm import LLM  # noqa: E402
from engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
