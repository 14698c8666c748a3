import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt: int) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams(temperature=0))


def test_allocate_exact_ids_and_lazy_growth():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", 6)
    assert bm.allocate_slots(a, 6) == [0, 1]
    bm.check_integrity()
    a.num_computed_tokens = 6
    assert bm.allocate_slots(a, 1) == []  # token 7 fits in block 1's tail
    a.num_computed_tokens = 7
    assert bm.allocate_slots(a, 1) == []  # token 8 fills block 1
    a.num_computed_tokens = 8
    assert bm.allocate_slots(a, 1) == [2]  # token 9 opens block 2
    assert bm.get_block_ids("a") == [0, 1, 2]
    assert [b.ref_cnt for b in bm.blocks[:4]] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_integrity()


def test_all_or_nothing_when_pool_is_short():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert bm.allocate_slots(a, 8) == [0, 1]
    assert bm.allocate_slots(b, 8) is None
    assert bm.get_block_ids("b") == []
    assert bm.num_free_blocks == 1
    bm.check_integrity()


def test_free_returns_tail_first_and_is_idempotent():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_request("a", 6), make_request("b", 2)
    bm.allocate_slots(a, 6)  # 0, 1, 2
    bm.allocate_slots(b, 2)  # 3
    bm.free(a)
    assert bm.free_queue.ids() == [4, 5, 2, 1, 0]
    bm.free(a)
    bm.check_integrity()
    assert bm.allocate_slots(make_request("c", 4), 4) == [4, 5]
    bm.free(b)
    assert bm.free_queue.ids() == [2, 1, 0, 3]
    bm.check_integrity()


def test_integrity_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots(make_request("a", 2), 2)
    bm.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError):
        bm.check_integrity()
    bm.blocks[0].ref_cnt = 1
    bm.check_integrity()
    bm.block_tables["ghost"] = [1]  # a block in a table but still in the free queue
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)


def test_the_runners_block_tables_free_reuse_and_refuse_rows():
    """Rows go back zeroed when a plan names their request gone, are reused, and a request beyond the rows is a
    clear error, not an IndexError."""
    from engine.block_table import BlockTables

    tables = BlockTables(2, 4)
    tables.update([], {"a": [3, 1], "b": [2]})
    tables.update([], {"a": [5]})
    assert tables.gather(["b", "a"]).tolist() == [[2, 0, 0], [3, 1, 5]]
    with pytest.raises(RuntimeError, match="no block-table row left for 'c': all 2 are held"):
        tables.update([], {"c": [7]})
    tables.update(["a"], {"c": [7]})
    assert tables.gather(["c"]).tolist() == [[7]] and tables.table[tables.rows["c"]].tolist() == [7, 0, 0, 0]
