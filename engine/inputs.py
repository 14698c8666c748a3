"""What a generate call or an HTTP request asks for, as engine requests: one per prompt and sample.

Shared by the offline ``LLM`` and the server, so both read a prompt argument and fan ``n`` out the same way. Light on
purpose: the API process imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.sampling_params import SamplingParams

PromptType = str | list[int]


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, or token ids) or several, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


@dataclass(frozen=True)
class Sample:
    """One engine request: sample ``index % n`` of prompt ``index // n``, under its own id and params."""

    request_id: str
    index: int
    params: SamplingParams


def fan_out(request_id: str, num_prompts: int, params: SamplingParams) -> list[Sample]:
    """The ``params.n`` samples of each of ``num_prompts`` prompts, numbered in prompt order; sample j of a prompt
    runs with n=1 and its seed offset by j (``SamplingParams.for_sample``)."""
    return [Sample(f"{request_id}-{i * params.n + j}", i * params.n + j, params.for_sample(j))
            for i in range(num_prompts) for j in range(params.n)]
