"""Triton kernels over the paged KV cache, each with a plain-torch reference in ``kernels/reference.py``.

Cache layout shared by every kernel (one K and one V pool per layer):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
(a CPU's int8 pool adds each head's scale after its values: ``kv_int8.py``; the Triton kernels read float pools).
Block tables: [num_reqs, max_num_blocks] int32; row r lists request r's block ids in token order, so token t of
request r lives in slot ``block_tables[r, t // block_size] * block_size + t % block_size``. Entries past a
request's last block are never read.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported).
"""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints: how many blocks (panels, words) of ``b`` hold ``a`` items."""
    return -(-a // b)
