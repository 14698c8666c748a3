"""What both attention kernels share: the online-softmax step for each block of keys, and how they compute.

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
