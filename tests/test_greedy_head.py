"""The screened greedy heads (``engine/backends/greedy_head.py``) against the full LM head: the same token ids,
ties and near-ties included, a bound that holds, and a refusal wherever it cannot decide. ``ScreenedGreedyHead``
screens an fp32 head with an int8 copy of it; ``Int8ScreenedHead`` screens a Q8 head with int8 activations."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends.greedy_head import (
    MAX_CANDIDATES,
    MAX_ROWS,
    SCREEN_TIMING_ROWS,
    Int8ScreenedHead,
    ScreenedGreedyHead,
    screen_row_range,
)
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


needs_int8_dots = pytest.mark.skipif(not cpu.q8x_available(), reason="no integer dot products on this CPU")
BLOCK_HIDDEN = 96  # three 32-input blocks


def make_block_head(seed: int = 0) -> tuple[Int8ScreenedHead, torch.Tensor]:
    """A head of Q8_0 values in Q8 panels, with the same exact tie and near-tie as ``make_head``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (VOCAB, BLOCK_HIDDEN // 32, 32), generator=gen)
    q[:, :, 0] = 127  # every block spans its scale
    d = (torch.rand(VOCAB, BLOCK_HIDDEN // 32, 1, generator=gen) * 1e-3 + 1e-4).half().float()
    q[999], d[999] = q[5], d[5]
    q[500], d[500] = q[7], d[7]
    q[500, 0, 1] += 1 if q[7, 0, 1] < 127 else -1  # a near-tie: one step of one weight apart
    w = (d * q).reshape(VOCAB, BLOCK_HIDDEN)
    packed = cpu.pack_weight_blocks(w)
    assert packed is not None and packed.dtype == torch.int8  # Q8 panels
    return Int8ScreenedHead(packed, VOCAB), packed


def awkward_rows(m: int, seed: int) -> torch.Tensor:
    """Rows whose int8 rounding errs most: one outlier a block (the rest round to few levels), tiny and huge
    scales, a block of zeros."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(m):
        h = torch.randn(BLOCK_HIDDEN, generator=gen) * (10.0 ** (i % 7 - 3))
        if i % 2:
            h[::32] *= 200.0
        if i % 3 == 0:
            h[32:64] = 0.0
        rows.append(h)
    return torch.stack(rows)


@needs_int8_dots
def test_q8x_rounding_error_is_that_of_the_int8_products():
    """The measured error is ||x - d q|| for the rounding the int8 products apply (d = max |x| / 127 per 32, q to
    nearest even), rounded up by no more than 2^-20."""
    x = awkward_rows(40, seed=1)
    blocks = x.view(40, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127  # fp32, as the kernel divides
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp(-127, 127)
    truth = (blocks.double() - d.double() * q.double()).pow(2).sum((1, 2)).sqrt()
    err = cpu.q8x_rounding_error(x)
    assert (err >= truth).all() and (err <= truth * (1 + 2**-19)).all()
    assert (truth <= (0.5 * d.double()).pow(2).mul(32).sum((1, 2)).sqrt()).all()  # half a step a value at most
    nan = x[:2].clone()
    nan[1, 5] = float("nan")
    assert torch.isfinite(cpu.q8x_rounding_error(nan)[0]) and not torch.isfinite(cpu.q8x_rounding_error(nan)[1])


@needs_int8_dots
def test_int8_screen_bound_holds():
    """|int8-activation logit - exact logit| <= s_m ||w'_j|| for every row and column, with awkward rows too."""
    head, packed = make_block_head(seed=1)
    gen = torch.Generator().manual_seed(2)
    for awkward, hidden in ((True, awkward_rows(64, seed=3)), (False, torch.randn(64, BLOCK_HIDDEN, generator=gen))):
        approx = cpu.linear(hidden, packed, VOCAB, int8_activations=True).double()
        exact = cpu.linear(hidden, packed, VOCAB).double()
        radius = head.row_scale(hidden)[:, None] * head.error[None, :]
        assert ((approx - exact).abs() <= radius).all()
        assert awkward or (radius < 0.05 * exact.abs().amax(dim=1, keepdim=True)).all()  # tight enough to screen


@needs_int8_dots
@pytest.mark.parametrize("m", [1, 5, 64])
def test_int8_screen_gives_the_exact_heads_tokens(m):
    head, packed = make_block_head()
    gen = torch.Generator().manual_seed(m)
    for hidden in [torch.randn(m, BLOCK_HIDDEN, generator=gen) * s for s in (1e-3, 1.0, 30.0, 1e3)]:
        assert torch.equal(head.argmax(hidden), full_argmax(hidden, packed))
    w = cpu.embed_rows(packed, torch.arange(VOCAB), VOCAB)
    hidden = torch.stack([w[5] * 40, w[7] * 40, w[500] * 40, -w[5] * 40])
    tokens = head.argmax(hidden)
    assert torch.equal(tokens, full_argmax(hidden, packed)) and tokens[0] == 5  # the lowest id of a tie


@needs_int8_dots
def test_int8_screen_refuses_or_computes_what_it_cannot_screen():
    head, packed = make_block_head()
    head.min_rows, head.max_rows = 2, 4
    for m in (1, 5):  # batch sizes start-up did not find it faster for
        assert head.argmax(torch.randn(m, BLOCK_HIDDEN)) is None
    assert head.argmax(torch.randn(2, BLOCK_HIDDEN)) is not None
    nan = torch.randn(2, BLOCK_HIDDEN)
    nan[1, 3] = float("nan")
    assert head.argmax(nan) is None
    # a row of zeros (every logit 0: VOCAB candidates) beside ordinary rows: its token from its exact logits
    hidden = torch.randn(3, BLOCK_HIDDEN)
    hidden[1] = 0.0
    assert VOCAB > MAX_CANDIDATES
    assert torch.equal(head.argmax(hidden), full_argmax(hidden, packed)) and head.argmax(hidden)[1] == 0
    with pytest.raises(ValueError, match="Q8 panels"):
        Int8ScreenedHead(cpu.pack_weight(torch.randn(VOCAB, BLOCK_HIDDEN)), VOCAB)


@needs_int8_dots
def test_screen_rows_is_a_run_of_the_timed_row_counts(monkeypatch):
    import engine.backends.greedy_head as greedy_head

    head, _ = make_block_head()
    (low, high), seconds = screen_row_range(head)
    assert set(seconds) >= {"screen@1", "exact@1"}
    assert (low, high) == (0, 0) or (low in SCREEN_TIMING_ROWS and high in SCREEN_TIMING_ROWS and low <= high)
    # where the screen loses at one row (bound by reading the head) and wins from four on, until 64
    faster = {1: False, 4: True, 16: True, 64: True, 256: False}
    timed = []

    def fake(fn, flush, rounds=3):
        if fn.func == head.argmax:  # the screen; else the exact head's argmax
            rows = fn.args[0].shape[0]
            timed.append(rows)
            return 1.0 if faster[rows] else 3.0
        return 2.0

    monkeypatch.setattr(greedy_head, "_cold_seconds", fake)
    monkeypatch.setattr(greedy_head, "SCREEN_TIMING_CALL_S", 10.0)  # every exact call within the budget
    assert screen_row_range(head)[0] == (4, 64) and timed == [1, 4, 16, 64, 256]
    faster.update({1: True, 4: False, 16: True})
    timed.clear()
    assert screen_row_range(head)[0] == (1, 1) and timed == [1, 4]  # the first run; larger batches not timed after it
    # a head whose exact product takes longer than the budget from 16 rows on: larger counts are not timed
    monkeypatch.setattr(greedy_head, "SCREEN_TIMING_CALL_S", 2.5)
    exact_seconds = {1: 2.0, 4: 2.0, 16: 3.0}

    def slow(fn, flush, rounds=3):
        if fn.func == head.argmax:
            timed.append(fn.args[0].shape[0])
            return 1.0
        return exact_seconds[timed[-1]]

    monkeypatch.setattr(greedy_head, "_cold_seconds", slow)
    timed.clear()
    assert screen_row_range(head)[0] == (1, 16) and timed == [1, 4, 16]
