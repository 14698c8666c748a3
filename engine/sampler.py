"""Turns the batch's logits into next tokens, vectorised over the batch (no per-request Python on the hot path
except the rows that carry their own seed).

Pipeline, per row:  grammar mask -> logit_bias -> min_tokens ban -> repetition/presence/frequency penalties
                        -> a forced token (a thinking bound) masks all others
                        = processed logits
                    greedy rows: argmax(processed)
                    random rows: / temperature -> min_p -> top_k/top_p -> softmax -> inverse-CDF draw
Logprobs are those of the processed logits (divided by the temperature on random rows), before the min_p,
top_k and top_p truncation: the top-N alternatives plus the sampled token's own, with its rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling_metadata import SamplingMetadata
from engine.structured_output import apply_bitmask


@dataclass
class TopLogprobs:
    """Row i: ``token_ids[i, 0]`` is the scored token (sampled, or the actual prompt token), then the top-N."""

    token_ids: torch.Tensor  # [B, 1 + N] int64
    logprobs: torch.Tensor  # [B, 1 + N] float32
    ranks: torch.Tensor  # [B] int64: 1 + number of tokens strictly more likely than the scored one


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as torch's: the first of equal maxima, NaN the largest. fp32 rows on a CPU go through
    numpy's, which took 0.55 ms for 64 rows of a 49,152-token vocabulary where torch's took 2.1 ms (one 64-client
    step on a Xeon with AMX: ~60 ms, of which torch's argmax was 5%)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1))
    return logits.argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: TopLogprobs | None


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:  # logits: [B, vocab] fp32
        logits = self.process_logits(logits, meta)
        greedy_ids = argmax_rows(logits)
        if meta.all_greedy:
            token_ids, scaled = greedy_ids, logits
        else:
            temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
            scaled = logits / temperature.unsqueeze(1)
            random_ids = self._sample(scaled, meta)
            token_ids = torch.where(meta.temperature == 0, greedy_ids, random_ids)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = top_logprobs(torch.log_softmax(scaled, dim=-1), token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The logits as the requests' grammars, biases, bans and penalties leave them: a new tensor where any
        applies, else ``logits`` itself (a copy of 64 rows of a 49152-token vocabulary is 12.6 MB to write)."""
        if any(x is not None for x in (meta.allowed_tokens, meta.logit_bias, meta.banned, meta.forced)):
            logits = logits.clone()  # written in place below; the caller's logits stay as they were (penalties make
            # a new tensor of their own)
        if meta.allowed_tokens is not None:  # first: -inf stays -inf through bias and penalties
            apply_bitmask(logits, *meta.allowed_tokens)
        if meta.logit_bias is not None:
            rows, ids, values = meta.logit_bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if meta.banned is not None:
            logits[meta.banned] = float("-inf")
        if meta.repetition_penalty is not None:
            logits = apply_penalties(logits, meta)
        if meta.forced is not None:  # last: nothing else may move a forced row
            rows, ids = meta.forced
            logits[rows] = float("-inf")
            logits[rows, ids] = 0.0
        return logits

    @staticmethod
    def _sample(scaled: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.min_p is not None:
            probs = scaled.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        if meta.top_k is not None or meta.top_p is not None:
            scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
        probs = scaled.softmax(dim=-1)
        # Inverse CDF: one uniform u per row; the token is the first whose running sum of probabilities (in float64)
        # exceeds u times their total, without a host sync. A token of probability 0 adds nothing to the sum, so it is
        # never drawn. Seeded rows draw u from their own generator, so their tokens do not depend on the batch.
        # NOTE: the exponential race this replaced (argmax p / E, E ~ Exp(1)) drew a number per vocabulary entry:
        # torch's exponential_ took 1.1 ms a row on the CPU, 76 ms a step at 64 rows of SmolLM2's 49152 tokens.
        u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
        for row, generator in meta.generators.items():
            u[row] = torch.rand(1, dtype=torch.float64, generator=generator).to(probs.device)
        cdf = probs.double().cumsum(dim=-1)
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        return ids.clamp_(max=probs.shape[1] - 1)  # only a NaN row could land past the end


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty (transformers' rule, over prompt and output tokens), then OpenAI's presence and
    frequency penalties (over output tokens only)."""
    batch, vocab = logits.shape
    output_counts = torch.zeros(batch, vocab + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, meta.output_token_ids, torch.ones_like(meta.output_token_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, meta.prompt_token_ids, True)
    seen = seen[:, :vocab] | (output_counts > 0)
    penalty = meta.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, penalised, logits)
    logits -= meta.frequency_penalty.unsqueeze(1) * output_counts
    logits -= meta.presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus (at least one token always survives)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1 - top_p.unsqueeze(1)
        outside[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num: int) -> TopLogprobs:
    """The scored token's logprob and rank plus the ``num`` most likely tokens of each row of ``logprobs``."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num > 0:
        top_values, top_ids = logprobs.topk(num, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), chosen
    return TopLogprobs(ids, values, ranks)
