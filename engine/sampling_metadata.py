"""Per-step sampling settings of the batch as tensors, built once per step from the requests that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.structured_output import new_bitmask


@dataclass
class SamplingMetadata:
    """Row i describes the i-th sampled request. Optional fields are ``None`` when no row needs them, so the common
    case (plain temperature or greedy sampling) runs none of the extra kernels."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [B] float32, 0.0 where disabled
    generators: dict[int, torch.Generator]  # row -> per-request generator (requests with a seed)
    presence_penalty: torch.Tensor | None  # [B]
    frequency_penalty: torch.Tensor | None  # [B]
    repetition_penalty: torch.Tensor | None  # [B]
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None  # [B, max_output_len] int64, padded with vocab_size
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked to -inf (min_tokens, a forced close)
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows, bitmask [rows, words]) of rows with a grammar
    # (rows, token ids): each row emits its token whatever the logits say (a thinking bound closing the thinking)
    forced: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None  # largest `logprobs` asked for in the batch, None if nobody asked
    # Every row takes the argmax of its raw logits (SamplingParams.plain_argmax, and no token banned for min_tokens).
    plain_greedy: bool

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: torch.device,
                      forced_token_ids: dict[str, int] | None = None) -> SamplingMetadata:
        """``forced_token_ids``: the step's forced tokens, by request id."""
        params = [r.sampling_params for r in requests]

        def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = column([p.temperature for p in params])
        random_rows = [p for p in params if not p.greedy]
        use_top_k = any(0 < p.top_k < vocab_size for p in random_rows)
        use_top_p = any(p.top_p < 1.0 for p in random_rows)
        use_min_p = any(p.min_p > 0.0 for p in random_rows)
        use_penalties = any(p.has_penalties for p in params)

        bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
        for row, request in enumerate(requests):
            p = request.sampling_params
            for token_id, value in p.logit_bias.items():
                bias_rows.append(row)
                bias_ids.append(token_id)
                bias_values.append(value)
            if request.num_output_tokens < p.min_tokens or (request.thinking and request.thinking.needs_answer):
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids))
                ban_rows += [row] * len(banned)
                ban_ids += sorted(banned)

        grammar_rows, starts = [], []
        for row, request in enumerate(requests):
            if request.grammar_active:
                grammar_rows.append(row)
            elif request.grammar is not None and request.thinking.start_continuation() is not None:
                grammar_rows.append(row)  # before the model shows whether it thinks: the grammar or a thinking block
                starts.append((len(grammar_rows) - 1, request.thinking.start_continuation()))
        bitmask = new_bitmask(len(grammar_rows), vocab_size) if grammar_rows else None
        for i, row in enumerate(grammar_rows):
            requests[row].grammar.fill_bitmask(bitmask, i)
        for i, token_id in starts:
            bitmask[i, token_id // 32] |= _bit(token_id % 32)
        forced = [(row, forced_token_ids[r.request_id]) for row, r in enumerate(requests)
                  if forced_token_ids and r.request_id in forced_token_ids]

        def padded(rows: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(r) for r in rows))
            return column([r + [vocab_size] * (width - len(r)) for r in rows], torch.int64)

        long = torch.int64
        return cls(
            temperature=temperature,
            all_greedy=not random_rows,
            top_k=column([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], long)
            if use_top_k
            else None,
            top_p=column([p.top_p for p in params]) if use_top_p else None,
            min_p=column([p.min_p for p in params]) if use_min_p else None,
            generators={row: r.generator for row, r in enumerate(requests) if r.generator is not None},
            presence_penalty=column([p.presence_penalty for p in params]) if use_penalties else None,
            frequency_penalty=column([p.frequency_penalty for p in params]) if use_penalties else None,
            repetition_penalty=column([p.repetition_penalty for p in params]) if use_penalties else None,
            prompt_token_ids=padded([r.prompt_token_ids for r in requests]) if use_penalties else None,
            output_token_ids=padded([r.output_token_ids for r in requests]) if use_penalties else None,
            logit_bias=(column(bias_rows, long), column(bias_ids, long), column(bias_values)) if bias_rows else None,
            banned=(column(ban_rows, long), column(ban_ids, long)) if ban_rows else None,
            allowed_tokens=(column(grammar_rows, long), bitmask.to(device)) if grammar_rows else None,
            forced=(column([f[0] for f in forced], long), column([f[1] for f in forced], long)) if forced else None,
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            plain_greedy=all(p.plain_argmax for p in params) and not ban_rows and not forced,
        )


def _bit(index: int) -> int:
    """Bit ``index`` of a bitmask word (int32: bit 31 is the sign)."""
    return (1 << index) - (1 << 32 if index == 31 else 0)
