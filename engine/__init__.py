"""Harpoon's engine: paged KV cache, continuous batching scheduler, model runner and sampler."""

import os
import sys

# NOTE: OpenMP reads this once, when torch loads; see engine/models/linear.py for why it matters (5x on decode
# GEMMs). If torch was loaded first without it, linear.py keeps to torch's own BLAS instead.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.llm import LLM  # noqa: E402
from engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
