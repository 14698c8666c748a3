"""N-gram speculative decoding (prompt lookup): draft tokens copied from earlier in a sequence, verified in one step.

Why: a decode step of a small model at a small batch streams every weight once for a single row, so a step that
computes a few more rows of the same request costs little more (memory-bound GEMMs). If the sequence's last n
tokens appeared before, the tokens that followed then are a cheap guess at what follows now; the model computes
the last token plus the k drafts as one query chunk and every draft that equals the model's own greedy choice is
kept, with one more token from the first row that disagrees (or the row after the last draft):

    all_token_ids  [ ... a b c d ... x a b c ]         last 3 tokens "a b c" seen before, followed by "d ..."
    step's query    c | d' e' f'                        c: last token (its K/V not computed yet), d' e' f': drafts
    greedy targets  t0  t1 t2 t3                        accepted: d' == t0, e' == t1, f' != t2 -> emit t0 t1 t2
    K/V kept        c d' e'                             num_computed_tokens += 3; f''s K/V is overwritten later

Outputs are exactly the tokens plain greedy steps give, only several per step: each row sees the same context it
would have seen token by token, and the C decoder computes a chunk's queries as single-token decode queries (the
same arithmetic). Only requests whose greedy token is the argmax of the raw logits (no penalties, bias, logprobs
or pending min_tokens) draft; sampled requests keep one token per step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.config import SpeculativeConfig
from engine.request import Request


def can_draft(request: Request) -> bool:
    """Whether the request's next tokens are plain argmaxes, so a draft is verified by comparing token ids."""
    return (request.sampling_params.plain_argmax and request.num_output_tokens >= request.sampling_params.min_tokens
            and (request.thinking is None or not request.thinking.may_force))


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` drafts: what followed the latest earlier occurrence of the sequence's last n tokens,
    for the largest n in [min_n, max_n] that has one. A match that runs into the end of the sequence repeats
    with its period (the sequence is looping)."""
    length = len(token_ids)
    if length < min_n + 1:
        return []
    tokens = np.asarray(token_ids[-4096:], dtype=np.int64)  # NOTE: a bounded window keeps a step's search O(1)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows[i] = tokens[i : i + n] for every start with a token after it, the suffix itself excluded
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token that followed the match
            period = length - start
            return [int(tokens[start + j % period]) for j in range(num_tokens)]
    return []


def accepted_tokens(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """The tokens a verify step emits: the greedy targets up to and including the first that differs from its
    draft (``target_ids`` has one more entry than ``draft_ids``: the row after the last draft)."""
    assert len(target_ids) == len(draft_ids) + 1
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return target_ids[: num_accepted + 1]


class NgramProposer:
    """Picks each running request's drafts for the next step (``Request.spec_token_ids``; the scheduler decides
    how many of them fit the step's token budget)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, running: list[Request]) -> None:
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        for request in running:
            request.spec_token_ids = self._drafts(request) if enabled else []

    def _drafts(self, request: Request) -> list[int]:
        if request.num_tokens - request.num_computed_tokens != 1 or not can_draft(request):
            return []  # mid-prompt, or a token that is not a plain argmax
        # A step emits at most drafts + 1 tokens: never more than max_tokens allows (which also keeps every draft's
        # position inside max_model_len).
        num = min(self.config.num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1)
        if num <= 0:
            return []
        return propose_ngram(request.all_token_ids, num, self.config.prompt_lookup_min, self.config.prompt_lookup_max)
