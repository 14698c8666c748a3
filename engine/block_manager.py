"""Hands out fixed-size KV-cache blocks from one preallocated pool, keeps each request's block table, and (with
prefix caching) lets requests share the full blocks of a common prefix.

    pool:          [ b0 | b1 | b2 | b3 | b4 | b5 | ... ]       num_blocks blocks of block_size slots each
    block table:   request "a" -> [b3, b0, b5]                 token t lives in slot
                                                               block_table[t // block_size] * block_size
                                                               + t % block_size

A request holds exactly ``cdiv(num_computed_tokens + num_scheduled_tokens, block_size)`` blocks, so the only
waste is the unfilled tail of its last block (after a verify step that rejected speculative drafts, it may also keep
the blocks of their slots, which its next tokens fill).

Prefix caching: once a full block's K/V is computed it is registered under its chained hash. A new request takes
the longest run of registered blocks matching its tokens (ref_cnt + 1, nothing recomputed). A freed block keeps its
hash and waits in the free queue, least recently used first; it is evicted only when a fresh block is needed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request
from kernels import cdiv

logger = logging.getLogger(__name__)


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full, computed and registered for reuse
    token_ids: tuple[int, ...] | None = None  # the tokens it holds, compared on a cache hit


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
    """Owns the pool's bookkeeping: the free queue, every block's ref count, every request's block table and the
    map from block hash to cached block.

    Invariants (``check_integrity``): free + used == num_blocks; a block is free iff its ref count is 0; a block's
    ref count equals the number of block tables holding it; every entry of the hash map points at a block carrying
    that hash; allocation is all or nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(list(range(num_blocks)))
        self.block_tables: dict[str, list[int]] = {}
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks of its table already registered
        self.num_query_tokens = 0  # prefix-cache lookups, in prompt tokens
        self.num_hit_tokens = 0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1] (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks matching the start of ``request``'s tokens. At least the last token
        is always left to compute, so the step has logits to sample from.

        NOTE: a request that asks for prompt logprobs takes no cached blocks (as in vLLM): its scores come from the
        logits of every prompt position, which a cache hit skips. It still registers its blocks for others."""
        if not self.enable_caching or request.prompt_logprobs_requested:
            return []
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block_id = self.cached_blocks.get(block_hash)
            tokens = tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        num_computed = request.num_computed_tokens + num_computed_blocks * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        return max(0, num_required - len(self.get_block_ids(request.request_id)) - num_computed_blocks)

    # ---- mutations -----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_block_ids: list[int] | None = None) -> list[int] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens after its computed ones (plus, for a request
        being admitted, the cached ``computed_block_ids`` it takes over). Return the fresh block ids, or ``None``,
        changing nothing, when the pool cannot supply them: the scheduler must then preempt or wait."""
        computed = computed_block_ids or []
        num_new_blocks = self.num_blocks_to_allocate(request, num_new_tokens, len(computed))
        if num_new_blocks == 0 and computed_block_ids is None:
            return []  # a running request whose last block has room: most decodes, every step
        num_revived = sum(1 for b in computed if self.blocks[b].ref_cnt == 0)  # cached, sitting in the free queue
        if num_new_blocks + num_revived > self.num_free_blocks:
            return None
        table = self.block_tables.setdefault(request.request_id, [])
        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free_queue.remove(block_id)
            block.ref_cnt += 1
            table.append(block_id)
        if computed_block_ids is not None:  # an admission: count the lookup
            self._num_registered[request.request_id] = len(computed)
            self.num_query_tokens += request.num_tokens
            self.num_hit_tokens += len(computed) * self.block_size
        new_block_ids = [self._take_free_block() for _ in range(num_new_blocks)]
        table.extend(new_block_ids)
        return new_block_ids

    def _take_free_block(self) -> int:
        block = self.blocks[self.free_queue.popleft()]
        assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
        if block.block_hash is not None:  # evict the least recently used cached block
            del self.cached_blocks[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_cnt = 1
        return block.block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks of ``request`` that became full and computed, so later requests can reuse them."""
        if not self.enable_caching:
            return
        done = self._num_registered.get(request.request_id, 0)
        if request.num_computed_tokens // self.block_size <= done:
            return  # no block filled since the last call: most steps
        table = self.get_block_ids(request.request_id)
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        if num_full <= done:
            return
        hashes = request.update_block_hashes(self.block_size)
        for i in range(done, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is None and hashes[i] not in self.cached_blocks:
                block.block_hash = hashes[i]
                block.token_ids = tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
                self.cached_blocks[hashes[i]] = block.block_id
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of ``request``. Idempotent, so finish, abort and preempt may all call it."""
        block_ids = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        # NOTE: the tail goes back first, so the tail is evicted before the head: a prefix stays reusable longest.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than allocated"
            if block.ref_cnt == 0:
                self.free_queue.append(block_id)

    def view(self, num_computed_tokens: dict[str, int], max_map_blocks: int = 1 << 16) -> dict:
        """The pool as the debug routes show it: counts, each request's table, and a map of the blocks' states
        (``.`` free, ``c`` free but cached: evictable, ``u`` held by one request, ``s`` shared) with the index of
        the request holding each in ``requests`` (-1: none); the map is left out of pools over ``max_map_blocks``.
        ``num_computed_tokens``: per request holding blocks, the tokens whose K/V are in them."""
        requests = []
        owner = [-1] * self.num_blocks
        for index, (request_id, table) in enumerate(self.block_tables.items()):
            computed = num_computed_tokens.get(request_id, 0)
            requests.append({"request_id": request_id, "blocks": len(table), "tokens": computed,
                             "shared_blocks": sum(1 for b in table if self.blocks[b].ref_cnt > 1),
                             "empty_slots": len(table) * self.block_size - computed})
            for block_id in table:
                if owner[block_id] < 0:
                    owner[block_id] = index
        cached_free = sum(1 for b in self.free_queue.ids() if self.blocks[b].block_hash is not None)
        view = {
            "block_size": self.block_size, "num_blocks": self.num_blocks, "free_blocks": self.num_free_blocks,
            "used_blocks": self.num_used_blocks, "cached_evictable_blocks": cached_free,
            "cached_blocks": len(self.cached_blocks), "empty_slots": sum(r["empty_slots"] for r in requests),
            "prefix_cache_hit_rate": self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0,
            "requests": requests,
        }
        if self.num_blocks <= max_map_blocks:
            state = "".join("s" if b.ref_cnt > 1 else "u" if b.ref_cnt else "c" if b.block_hash is not None else "."
                            for b in self.blocks)
            view["block_states"], view["block_owners"] = state, owner
        return view

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
        for block_hash, block_id in self.cached_blocks.items():
            assert self.blocks[block_id].block_hash == block_hash, f"hash map entry of block {block_id} is stale"
        assert len(self.cached_blocks) == sum(1 for b in self.blocks if b.block_hash is not None)
