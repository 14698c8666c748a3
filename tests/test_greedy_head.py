"""The screened greedy head (``engine/backends/greedy_head.py``) against the full fp32 LM head: the same token ids,
ties and near-ties included, a bound that holds, and a refusal wherever it cannot decide."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends.greedy_head import MAX_ROWS, ScreenedGreedyHead
from kernels import cpu
from tests.conftest import TINY_CONFIGS

VOCAB, HIDDEN = 1000, 64  # 1000 is not a multiple of the panel width: the last panel is partial


def make_head(seed: int = 0) -> tuple[ScreenedGreedyHead, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.1
    w[999] = w[5]  # an exact tie across panels, one of them the partial last one: the lower id must win
    w[500] = w[7]
    w[500, 0] = torch.nextafter(w[7, 0], torch.tensor(float("inf")))  # a near-tie a rounding step apart
    packed = cpu.pack_weight(w)
    return ScreenedGreedyHead(packed, VOCAB), packed


def full_argmax(hidden: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return cpu.linear(hidden, packed, VOCAB).argmax(dim=1)


@pytest.mark.parametrize("m", [1, 2, 5, MAX_ROWS])
def test_same_tokens_as_the_full_head(m):
    head, packed = make_head()
    gen = torch.Generator().manual_seed(m)
    for scale in (1e-3, 1.0, 30.0, 1e3):
        hidden = torch.randn(m, HIDDEN, generator=gen) * scale
        assert torch.equal(head.argmax(hidden), full_argmax(hidden, packed))


def test_ties_and_near_ties_resolve_as_the_full_head_does():
    head, packed = make_head()
    w = packed.permute(0, 2, 1).reshape(-1, HIDDEN)[:VOCAB]
    hidden = torch.stack([w[5] * 40, w[7] * 40, w[500] * 40, -w[5] * 40])
    for row in hidden:  # one row at a time and all together: rows do not depend on each other
        assert torch.equal(head.argmax(row[None]), full_argmax(row[None], packed))
    tokens = head.argmax(hidden)
    assert torch.equal(tokens, full_argmax(hidden, packed))
    assert tokens[0] == 5  # rows 5 and 999 are equal: the lowest id, as torch.argmax picks


def test_error_bound_holds():
    head, packed = make_head(seed=1)
    gen = torch.Generator().manual_seed(2)
    for scale in (1e-4, 1.0, 1e4):
        hidden = torch.randn(MAX_ROWS, HIDDEN, generator=gen) * scale
        approx = cpu.linear_int8(hidden, head.quantized, head.scales, VOCAB).double()
        exact = cpu.linear(hidden, packed, VOCAB).double()
        radius = hidden.double().norm(dim=1, keepdim=True) * head.error
        assert ((approx - exact).abs() <= radius).all()
        assert (radius < 0.05 * exact.abs().amax(dim=1, keepdim=True)).all()  # and is tight enough to screen


def test_int8_weights_round_each_row_to_its_scale():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(49, 8, generator=gen)
    w[3] = 0.0  # an all-zero row: scale 0, no division by it
    packed, scales = cpu.pack_weight_int8(w)
    q = cpu.int8_rows(packed, 49).double()
    assert q.abs().max() <= 127 and q[3].abs().max() == 0
    dequantized = q * scales[:49].double().unsqueeze(1)
    assert ((dequantized - w.double()).abs() <= scales[:49].double().unsqueeze(1) * 0.5001).all()
    x = torch.randn(9, 8, generator=gen)
    assert torch.allclose(cpu.linear_int8(x, packed, scales, 49).double(), x.double() @ dequantized.T, atol=1e-4)
    with pytest.raises(ValueError, match="divisible by 4"):
        cpu.pack_weight_int8(torch.randn(4, 6))


def test_building_in_chunks_gives_the_same_head(monkeypatch):
    import engine.backends.greedy_head as greedy_head

    whole, packed = make_head(seed=5)
    monkeypatch.setattr(greedy_head, "BUILD_CHUNK", 3 * HIDDEN * packed.shape[2])  # 3 panels a chunk, 14 chunks
    chunked = ScreenedGreedyHead(packed, VOCAB)
    assert torch.equal(chunked.quantized, whole.quantized) and torch.equal(chunked.scales, whole.scales)
    assert torch.equal(chunked.error, whole.error)


def test_refuses_what_it_cannot_decide():
    head, packed = make_head()
    assert head.argmax(torch.randn(MAX_ROWS + 1, HIDDEN)) is None  # a batch the full head serves faster
    nan = torch.randn(2, HIDDEN)
    nan[1, 3] = float("nan")
    assert head.argmax(nan) is None
    assert head.argmax(torch.zeros(1, HIDDEN)) is None  # every logit 0: a thousand candidates, more than allowed
    flat = ScreenedGreedyHead(cpu.pack_weight(torch.ones(VOCAB, HIDDEN)), VOCAB)
    assert flat.argmax(torch.randn(1, HIDDEN)) is None


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_engine_takes_plain_greedy_tokens_from_the_screened_head(kind, tiny_model):
    """Plain greedy batches never compute the full logits on the C kernels' path, and give the tokens of the full
    path (forced here by asking for logprobs), step for step."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 4, 17, 40, 9, 2)]
    llm = LLM(str(tiny_model(kind)), block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              attention_backend="cpu", gemm_kernels="c")
    model = llm.engine.model
    assert llm.engine.backend.greedy_head is not None
    calls = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: calls.append(hidden.shape[0]) or compute_logits(hidden)
    screened = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert calls == []
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=0))
    assert calls
    assert [o.outputs[0].token_ids for o in screened] == [o.outputs[0].token_ids for o in full]
