"""Runs one scheduled step: builds the flattened batch, runs the model, samples, and scores prompt tokens.

The runner sees only a ``SchedulerOutput`` (which requests, how many tokens each, their block tables); it never
changes request state, so the scheduler stays the single owner of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.backends.base import TorchBackend
from engine.block_table import BlockTables
from engine.kv_cache import KVCache
from engine.models.llama import LlamaForCausalLM
from engine.outputs import Logprob, ModelRunnerOutput, PositionLogprobs
from engine.pooler import Pooler
from engine.request import Request
from engine.sampler import Sampler, TopLogprobs, argmax_rows, top_logprobs
from engine.sampling_metadata import SamplingMetadata
from engine.scheduler import SchedulerOutput
from engine.spec_decode import accepted_tokens
from engine.tp_workers import TPWorkers
from kernels import cdiv


@dataclass
class _Verification:
    request: Request
    first_row: int  # hidden-state rows first_row .. first_row + len(draft_ids): the last token's, then each draft's
    draft_ids: list[int]


@dataclass
class _PromptScoring:
    request: Request
    rows: list[int]  # hidden-state rows whose logits score the next prompt token
    target_ids: list[int]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: TorchBackend, vocab_size: int,
                 max_num_seqs: int, max_model_len: int, tp_workers: TPWorkers | None = None,
                 pooler: Pooler | None = None) -> None:
        """``pooler``: an embedding model's (its requests are pooled, never sampled)."""
        self.model = model
        self.pooler = pooler
        self.tp_workers = tp_workers  # the other tensor-parallel ranks, which run every forward beside this one
        self.kv_cache = kv_cache
        # NOTE: + 1: a verify step's drafts may reach one block past the context's last (never read as context).
        self.block_tables = BlockTables(max_num_seqs, cdiv(max_model_len, kv_cache.spec.block_size) + 1)
        self.backend = backend  # runs the step's forward, and greedy heads where it has one
        self.device = backend.device
        self.vocab_size = vocab_size
        self.block_size = kv_cache.spec.block_size
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The step's new tokens (and logprobs), with the time its parts took."""
        started_at = time.perf_counter()
        out = self._execute(sched, started_at)
        out.sample_s = time.perf_counter() - started_at - out.prepare_s - out.forward_s
        return out

    def _execute(self, sched: SchedulerOutput, started_at: float) -> ModelRunnerOutput:
        self.block_tables.update(sched.finished_request_ids, sched.new_block_ids)
        if self.pooler is not None:
            for request_id in sched.finished_request_ids:
                self.pooler.drop(request_id)  # left before its prompt was done (aborted, preempted)
        requests = sched.scheduled_requests  # single-token queries first: the attention batches them together
        input_ids, positions, qsl, seq_lens = [], [], [0], []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        scorings: list[_PromptScoring] = []
        verifications: list[_Verification] = []
        pooled: list[tuple[Request, int, int, bool]] = []  # (request, first row, rows, its prompt's first chunk)
        for request in requests:
            start = request.num_computed_tokens
            end = start + sched.num_scheduled_tokens[request.request_id]
            draft_ids = sched.spec_token_ids.get(request.request_id)
            input_ids += request.all_token_ids[start:end] + (draft_ids or [])
            positions += range(start, end)
            if self.pooler is not None:
                pooled.append((request, qsl[-1], end - start, start == 0))
            elif draft_ids:  # the last token and its drafts: every row's greedy token is checked
                verifications.append(_Verification(request, qsl[-1], draft_ids))
            elif end == request.num_tokens:  # the chunk reaches the last known token: sample the next one
                sample_rows.append(qsl[-1] + end - start - 1)
                sampled.append(request)
            scoring = self._prompt_scoring(request, start, end, qsl[-1])
            if scoring is not None:
                scorings.append(scoring)
            qsl.append(qsl[-1] + end - start)
            seq_lens.append(end)
        meta = self._attention_metadata(requests, positions, qsl, seq_lens)  # on the host
        ids = torch.tensor(input_ids, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        prepared = time.perf_counter()
        if self.tp_workers is not None:
            self.tp_workers.dispatch(ids, pos, meta)
        hidden = self.backend.forward(self.model, ids, pos, self.kv_cache.layers, meta)  # [num_tokens, hidden]
        if self.tp_workers is not None:
            self.tp_workers.forward_done()
        out = ModelRunnerOutput(prepare_s=prepared - started_at, forward_s=time.perf_counter() - prepared)
        for request, first_row, num_rows, first in pooled:
            self.pooler.add(request.request_id, hidden[first_row : first_row + num_rows], first)
            if request.num_computed_tokens + num_rows == request.num_prompt_tokens:
                out.pooled[request.request_id] = self.pooler.finish(request.request_id, request.num_prompt_tokens)
        prompt_rows = [row for s in scorings for row in s.rows]
        verify_rows = [v.first_row + i for v in verifications for i in range(len(v.draft_ids) + 1)]
        if not sample_rows and not verify_rows and not prompt_rows:
            return out  # only prefill chunks that end mid-prompt: K/V written, nothing to sample or score
        rows = hidden[torch.tensor(sample_rows + verify_rows + prompt_rows, dtype=torch.int64, device=self.device)]
        sampling = SamplingMetadata.from_requests(sampled, self.vocab_size, self.device,
                                                  sched.forced_token_ids) if sampled else None
        num_sampled, num_greedy = len(sampled), len(sampled) + len(verify_rows)
        if (sampling is None or sampling.plain_greedy) and not scorings:
            token_ids = self.backend.greedy_tokens(rows)  # the argmax without the full logits, where it can
            if token_ids is not None:
                ids = token_ids.tolist()
                out.sampled_token_ids = {r.request_id: [t] for r, t in zip(sampled, ids, strict=False)}
                _verify(verifications, ids[num_sampled:], out)
                return out
        logits = self.model.compute_logits(rows)
        out.num_logit_rows = rows.shape[0]

        if verifications:  # drafting requests take the plain argmax (spec_decode.can_draft)
            _verify(verifications, argmax_rows(logits[num_sampled:num_greedy]).tolist(), out)
        if sampling is not None:
            result = self.sampler(logits[:num_sampled], sampling)
            token_ids = result.token_ids.tolist()
            for i, request in enumerate(sampled):
                out.sampled_token_ids[request.request_id] = [token_ids[i]]
            if result.logprobs is not None:
                per_row = _to_python(result.logprobs)
                for i, request in enumerate(sampled):
                    if request.sampling_params.logprobs is not None:
                        out.logprobs[request.request_id] = _position(per_row[i], request.sampling_params.logprobs)
        if scorings:
            self._score_prompts(logits[num_greedy:], scorings, out)
        return out

    @staticmethod
    def _prompt_scoring(request: Request, start: int, end: int, row_offset: int) -> _PromptScoring | None:
        """Position p's logits score prompt token p + 1; skip positions already scored before a preemption."""
        if request.sampling_params.prompt_logprobs is None:
            return None
        first = max(start, request.num_prompt_logprobs_done)
        last = min(end, request.num_prompt_tokens - 1)
        if first >= last:
            return None
        rows = [row_offset + p - start for p in range(first, last)]
        return _PromptScoring(request, rows, request.prompt_token_ids[first + 1 : last + 1])

    def _score_prompts(self, logits: torch.Tensor, scorings: list[_PromptScoring], out: ModelRunnerOutput) -> None:
        targets = torch.tensor([t for s in scorings for t in s.target_ids], dtype=torch.int64, device=self.device)
        num = max(s.request.sampling_params.prompt_logprobs for s in scorings)
        per_row = _to_python(top_logprobs(torch.log_softmax(logits, dim=-1), targets, num))
        row = 0
        for s in scorings:
            want = s.request.sampling_params.prompt_logprobs
            out.prompt_logprobs[s.request.request_id] = [_position(r, want) for r in per_row[row : row + len(s.rows)]]
            row += len(s.rows)

    def _attention_metadata(
        self, requests: list[Request], positions: list[int], qsl: list[int], seq_lens: list[int]
    ) -> AttentionMetadata:
        block_tables = self.block_tables.gather([r.request_id for r in requests])
        query_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(requests))])
        pos = torch.tensor(positions, dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(len(requests)), query_lens)
        slots = block_tables[req_of_token, pos // self.block_size].long() * self.block_size + pos % self.block_size
        num_decodes = sum(1 for i in range(len(requests)) if qsl[i + 1] - qsl[i] == 1)
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            num_decodes=num_decodes,
            max_query_len=int(query_lens.max()),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            req_of_token=req_of_token,
        )


def _verify(verifications: list[_Verification], target_ids: list[int], out: ModelRunnerOutput) -> None:
    """Each drafting request's new tokens from its rows' greedy tokens, taken in order from ``target_ids``."""
    offset = 0
    for v in verifications:
        num_rows = len(v.draft_ids) + 1
        targets = target_ids[offset : offset + num_rows]
        out.sampled_token_ids[v.request.request_id] = accepted_tokens(v.draft_ids, targets)
        offset += num_rows


def _to_python(top: TopLogprobs) -> list[tuple[list[int], list[float], int]]:
    return list(zip(top.token_ids.tolist(), top.logprobs.tolist(), top.ranks.tolist(), strict=True))


def _position(row: tuple[list[int], list[float], int], num: int) -> PositionLogprobs:
    """The scored token with its rank, then the top ``num`` alternatives with ranks 1..num."""
    ids, values, rank = row
    entry = {ids[0]: Logprob(values[0], rank)}
    for i in range(1, num + 1):
        entry.setdefault(ids[i], Logprob(values[i], i))
    return entry
