"""The runner's copy of the block tables, kept between steps: each plan brings only what changed.

    rows:   request "a" -> row 3      table[3] = [b7, b2, b9, 0, ...]   num_blocks[3] = 3
    plan:   new_block_ids {"a": [b4]}  ->  table[3] = [b7, b2, b9, b4, ...]
            finished_request_ids ["a"] ->  row 3 zeroed and free again

A step's tables are then one gather of its requests' rows (C speed), instead of a tensor built from Python lists of
every request's whole table; a worker process (tensor parallelism) receives the same small deltas.
"""

from __future__ import annotations

import torch


class BlockTables:
    """Invariant: ``table[rows[r], :num_blocks[rows[r]]]`` equals the block manager's table of request r as of the
    latest plan applied; every other entry is 0 (a valid block id, so a masked read stays in the pool)."""

    def __init__(self, max_num_reqs: int, max_num_blocks: int) -> None:
        self.table = torch.zeros(max_num_reqs, max_num_blocks, dtype=torch.int32)  # [rows, blocks]
        self.num_blocks = [0] * max_num_reqs
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def update(self, finished_request_ids: list[str], new_block_ids: dict[str, list[int]]) -> None:
        """Apply a plan's changes: drop the tables of requests gone, then append each request's new blocks (a
        request not held yet gets a row)."""
        for request_id in finished_request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self.table[row, : self.num_blocks[row]] = 0
                self.num_blocks[row] = 0
                self._free_rows.append(row)
        for request_id, block_ids in new_block_ids.items():
            row = self.rows.get(request_id)
            if row is None:
                if not self._free_rows:  # the scheduler runs at most that many: a gone request's row was never freed
                    raise RuntimeError(f"no block-table row left for {request_id!r}: all {len(self.table)} are held")
                row = self.rows[request_id] = self._free_rows.pop()
            start = self.num_blocks[row]
            if block_ids:
                self.table[row, start : start + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
                self.num_blocks[row] = start + len(block_ids)

    def gather(self, request_ids: list[str]) -> torch.Tensor:
        """The tables of ``request_ids``, in that order: [len(request_ids), longest table] int32, contiguous."""
        rows = [self.rows[r] for r in request_ids]
        width = max(self.num_blocks[row] for row in rows)
        return self.table[torch.tensor(rows), :width]
