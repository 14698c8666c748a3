"""Hands out fixed-size KV-cache blocks from one preallocated pool and keeps each request's block table.

    pool:          [ b0 | b1 | b2 | b3 | b4 | b5 | ... ]       num_blocks blocks of block_size slots each
    block table:   request "a" -> [b3, b0, b5]                 token t lives in slot
                                                               block_table[t // block_size] * block_size
                                                               + t % block_size

A request holds exactly ``cdiv(num_computed_tokens + num_scheduled_tokens, block_size)`` blocks, so the only
waste is the unfilled tail of its last block.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0


class FreeBlockQueue:
    """Free blocks in the order they should be handed out: O(1) pop from the front, append and remove anywhere."""

    def __init__(self, block_ids: list[int]) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def popleft(self) -> int:
        return self._queue.popitem(last=False)[0]

    def append(self, block_id: int) -> None:
        assert block_id not in self._queue, f"block {block_id} freed twice"
        self._queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def ids(self) -> list[int]:
        return list(self._queue)


class BlockManager:
    """Owns the pool's bookkeeping: the free queue, every block's ref count and every request's block table.

    Invariants (``check_integrity``): free + used == num_blocks; a block is free iff its ref count is 0; a block's
    ref count equals the number of block tables holding it; allocation is all or nothing.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(list(range(num_blocks)))
        self.block_tables: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        num_required = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, num_required - len(self.get_block_ids(request.request_id)))

    # ---- mutations -----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens; return the new block ids, or ``None`` (and
        change nothing) when the pool cannot supply them, which tells the scheduler to preempt or wait."""
        num_new_blocks = self.num_blocks_to_allocate(request, num_new_tokens)
        if num_new_blocks > self.num_free_blocks:
            return None
        new_block_ids = [self.free_queue.popleft() for _ in range(num_new_blocks)]
        for block_id in new_block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"block {block_id} in the free queue has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
        self.block_tables.setdefault(request.request_id, []).extend(new_block_ids)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release every block of ``request``. Idempotent, so finish, abort and preempt may all call it."""
        block_ids = self.block_tables.pop(request.request_id, [])
        # NOTE: the tail block goes back first, so if blocks are later reused from the front of the queue the
        # blocks at the start of a sequence (the ones most worth keeping for prefix reuse) go last.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than allocated"
            if block.ref_cnt == 0:
                self.free_queue.append(block_id)

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. Cheap enough for tests to call every step."""
        holders = [0] * self.num_blocks
        for request_id, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"request {request_id} holds a block twice: {table}"
            for block_id in table:
                holders[block_id] += 1
        num_free = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref_cnt {block.ref_cnt}"
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders[block.block_id]} tables"
            )
            is_free = block.block_id in self.free_queue
            assert is_free == (block.ref_cnt == 0), f"block {block.block_id}: free={is_free} ref_cnt={block.ref_cnt}"
            num_free += is_free
        assert num_free == len(self.free_queue)
        assert num_free + sum(1 for h in holders if h > 0) == self.num_blocks, "free + used != total"
