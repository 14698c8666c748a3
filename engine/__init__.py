"""Harpoon's engine: paged KV cache, continuous batching scheduler, model runner and sampler."""

from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
