"""What both attention kernels share: loading one page of K/V, the online-softmax step over it, and how they
compute.

State per query row: ``m_i`` the running max of the scores, ``l_i`` the running sum of exp(score - m_i), and
``acc`` the running sum of exp(score - m_i) * value; the attention output is acc / l_i once every block is seen.
"""

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def compute_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast, dot precision) for inputs of ``dtype``. Loads are upcast to fp32 under the interpreter (its
    half-precision math is wrong) and for fp32 inputs; fp32 dots then run in full IEEE precision, not TF32."""
    upcast = _INTERPRET or dtype == torch.float32
    return upcast, "ieee" if upcast else "tf32"


MIN_DOT_DIM = 16


def check_dot_shapes(block_size: int, head_dim: int, device: torch.device) -> None:
    """Both kernels multiply [rows, head_dim] by [head_dim, block_size] and [rows, block_size] by [block_size,
    head_dim] with tl.dot, which on a GPU needs every dimension >= 16: an H100 (Triton 3.6) gave wrong attention
    with 4- and 8-token pages, which the interpreter, checking nothing, computed right."""
    if device.type == "cuda" and (block_size < MIN_DOT_DIM or head_dim < MIN_DOT_DIM):
        raise ValueError(f"the Triton attention kernels need block_size and head_dim >= {MIN_DOT_DIM} on a GPU, got "
                         f"block_size {block_size}, head_dim {head_dim}")


@triton.jit
def load_kv_page(  # noqa: ANN201  (a Triton device function)
    k_cache_ptr,
    v_cache_ptr,
    block_id,  # int64 id of the page in the pool
    offs_n,  # [BLOCK_SIZE] slot offsets inside the page
    offs_d,  # [HEAD_DIM]
    mask_n,  # [BLOCK_SIZE] which slots hold keys this program may read
    kv_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """K and V of one KV head for the slots of one page, [BLOCK_SIZE, HEAD_DIM] each; 0 where ``mask_n`` is off."""
    row = NUM_KV_HEADS * HEAD_DIM  # elements between consecutive slots of the pool
    offs_kv = block_id * BLOCK_SIZE * row + offs_n[:, None] * row + kv_head * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_cache_ptr + offs_kv, mask=mask_n[:, None], other=0.0)
    v = tl.load(v_cache_ptr + offs_kv, mask=mask_n[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(  # noqa: ANN201  (a Triton device function: tensors are typed by Triton itself)
    acc,  # [ROWS, HEAD_DIM] fp32
    m_i,  # [ROWS] fp32
    l_i,  # [ROWS] fp32
    s,  # [ROWS, KEYS] fp32 scores of this block, -inf where a key is not visible
    v,  # [KEYS, HEAD_DIM] values of this block
    DOT_PRECISION: tl.constexpr,
):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
