"""Pools an embedding model's hidden states into one vector per input, as the steps compute them
(engine/pooling.py says which pooling)."""

from __future__ import annotations

import torch

from engine.pooling import PoolingSpec


class Pooler:
    """Pools prompts chunk by chunk as the steps compute them (a long input spans several steps): a mean keeps a
    running sum, CLS the first row, last-token the final row. Keyed by request id; ``finish`` hands the vector back
    and forgets the request, ``drop`` forgets one that left unfinished."""

    def __init__(self, spec: PoolingSpec) -> None:
        self.spec = spec
        self._partial: dict[str, torch.Tensor] = {}

    def add(self, request_id: str, rows: torch.Tensor, first: bool) -> None:
        """``rows``: the hidden states of a chunk of the prompt; ``first``: it starts the prompt."""
        kind = self.spec.kind
        if kind == "mean":
            total = rows.float().sum(dim=0)
            self._partial[request_id] = total if first else self._partial[request_id] + total
        elif kind == "cls" and first:
            self._partial[request_id] = rows[0].float()
        elif kind == "last":
            self._partial[request_id] = rows[-1].float()

    def finish(self, request_id: str, num_tokens: int) -> list[float]:
        vector = self._partial.pop(request_id)
        if self.spec.kind == "mean":
            vector = vector / num_tokens
        if self.spec.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu().tolist()

    def drop(self, request_id: str) -> None:
        self._partial.pop(request_id, None)
