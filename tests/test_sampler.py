"""Sampler unit tests on hand-made logits."""

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, apply_penalties, argmax_rows
from engine.sampling_metadata import SamplingMetadata
from engine.sampling_params import SamplingParams

VOCAB = 8
EOS = 2


def request(i: int, output: list[int] | None = None, prompt: list[int] | None = None, **params) -> Request:
    r = Request(f"r{i}", prompt or [1, 3], SamplingParams(**params), frozenset({EOS}), 100)
    for t in output or []:
        r.append_output_token(t)
    return r


def sample(logits: torch.Tensor, requests: list[Request]):
    meta = SamplingMetadata.from_requests(requests, VOCAB, torch.device("cpu"))
    return Sampler()(logits, meta)


def test_greedy_is_exact_argmax_beside_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    reqs = [request(i, temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = sample(logits, reqs)
    assert out.token_ids[0::2].tolist() == logits.argmax(-1)[0::2].tolist()


def test_top_k_1_top_p_tiny_and_min_p_1_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB) * 3
    reqs = [request(0, top_k=1), request(1, top_p=1e-6), request(2, min_p=1.0)]
    for _ in range(20):
        assert sample(logits, reqs).token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_and_top_p_never_leave_their_set():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]]).repeat(2, 1)
    probs = logits[0].softmax(-1)
    # top_p=0.9 keeps the smallest prefix of the sorted distribution whose mass reaches 0.9.
    nucleus = int((probs.cumsum(-1) < 0.9).sum()) + 1
    seen_k, seen_p = set(), set()
    for seed in range(300):
        out = sample(logits, [request(0, top_k=3, seed=seed), request(1, top_p=0.9, seed=seed)])
        seen_k.add(int(out.token_ids[0]))
        seen_p.add(int(out.token_ids[1]))
    assert seen_k == {0, 1, 2}
    assert seen_p == set(range(nucleus))


def test_min_p_masks_relative_to_the_top_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08, 0, 0, 0, 0]]) + 1e-12)
    seen = {int(sample(logits, [request(0, min_p=0.2, seed=s)]).token_ids[0]) for s in range(300)}
    assert seen == {0, 1, 2}  # 0.08 < 0.2 * 0.5


def test_sampling_follows_the_distribution():
    torch.manual_seed(5)  # unseeded rows draw from the global generator: fix it so the test is deterministic
    probs = torch.tensor([0, 0.5, 0.25, 0.125, 0.125, 0, 0, 0])  # the first and last tokens too are impossible
    logits = torch.log(probs).repeat(4000, 1)
    out = sample(logits, [request(i) for i in range(4000)])
    freq = torch.bincount(out.token_ids, minlength=VOCAB).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    assert set(out.token_ids.tolist()) == {1, 2, 3, 4}  # probability 0 is never drawn


@pytest.mark.parametrize("u", [0.0, 0.5, 1 - 2**-53])  # the extremes of torch.rand's float64 range
def test_every_uniform_draws_a_possible_token(u, monkeypatch):
    probs = torch.tensor([0, 0.5, 0, 0.25, 0.25, 0, 0, 0])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, u, dtype=kw.get("dtype")))
    token = int(sample(torch.log(probs).unsqueeze(0), [request(0)]).token_ids[0])
    assert token == {0.0: 1, 0.5: 3}.get(u, 4)


def test_temperature_sharpens():
    torch.manual_seed(6)
    logits = torch.tensor([[1.0, 0.0, 0, 0, 0, 0, 0, 0]]).repeat(3000, 1)
    cold = sample(logits, [request(i, temperature=0.1) for i in range(3000)]).token_ids
    assert (cold == 0).float().mean() > 0.99


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB)
    alone = sample(logits[2:3], [request(0, seed=42)]).token_ids.tolist()
    batch = [request(0, temperature=0.7), request(1), request(2, seed=42), request(3, seed=7)]
    assert sample(logits, batch).token_ids[2:3].tolist() == alone


def test_logit_bias_and_min_tokens_ban():
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    out = sample(
        logits,
        [request(0, temperature=0, logit_bias={5: 100.0}), request(1, temperature=0, min_tokens=1, stop_token_ids=[6])],
    )
    assert out.token_ids[0] == 5
    assert out.token_ids[1] not in (EOS, 6)
    # Once min_tokens are out, EOS is allowed again.
    out = sample(logits, [request(0, output=[4], temperature=0, min_tokens=1)])
    assert out.token_ids[0] == EOS


def test_penalties_match_a_plain_loop():
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB) * 2
    reqs = [
        request(
            0, prompt=[1, 1, 3], output=[4, 4, 5], repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25
        ),
        request(1, prompt=[7], output=[], repetition_penalty=0.8),
    ]
    meta = SamplingMetadata.from_requests(reqs, VOCAB, torch.device("cpu"))
    got = apply_penalties(logits.clone(), meta)
    expected = logits.clone()
    for row, r in enumerate(reqs):
        p = r.sampling_params
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            v = expected[row, t]
            expected[row, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(r.output_token_ids):
            expected[row, t] -= p.frequency_penalty * r.output_token_ids.count(t) + p.presence_penalty
    assert torch.allclose(got, expected)


def test_logprobs_are_processed_logprobs_with_ranks():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0, 0, 0, 0, -1.0], [0.0, 3.0, 1.0, 0, 0, 0, 0, 0]])
    out = sample(logits, [request(0, temperature=0, logprobs=2), request(1, temperature=0.5, logprobs=2, top_k=1)])
    lp = out.logprobs
    assert lp.token_ids[0].tolist() == [0, 0, 1]
    assert lp.logprobs[0, 0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())
    assert lp.ranks.tolist() == [1, 1]
    # Random rows report the temperature-scaled distribution (before top-k truncation).
    assert lp.logprobs[1, 0].item() == pytest.approx(torch.log_softmax(logits[1] / 0.5, -1)[1].item())
    assert math.isfinite(lp.logprobs[1, 2].item())


def test_invalid_sampling_params_are_rejected():
    for bad in (
        dict(temperature=-0.1),
        dict(temperature=2.5),
        dict(top_p=0.0),
        dict(n=0),
        dict(max_tokens=0),
        dict(logprobs=21),
        dict(min_tokens=5, max_tokens=2),
        dict(stop=["a", "b", "c", "d", "e"]),
        dict(logit_bias={1: 200.0}),
        dict(repetition_penalty=0.0),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize("params", [{}, {"logit_bias": {5: 100.0}}, {"repetition_penalty": 2.0},
                                    {"frequency_penalty": 1.0}, {"temperature": 1.0, "seed": 0}])
def test_the_callers_logits_are_left_as_they_were(params):
    """Prompt scoring and draft verification read the same logits after the sampler: a bias or a penalty goes into
    a copy, and without any the logits are not copied at all."""
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    out = sample(logits, [request(0, **params), request(1)])
    assert torch.equal(logits, before)
    if "logit_bias" in params:
        assert out.token_ids[0] == 5


def test_argmax_rows_is_torchs_argmax():
    """The first of equal maxima, NaN the largest, -inf rows at 0, strided rows; other dtypes keep torch's."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 3000, generator=gen)
    logits[1, [5, 100]] = float("nan")
    logits[2] = float("-inf")
    logits[3, [7, 9]] = 1e9
    logits[4, [10, 20]] = float("inf")
    logits[5, :] = 0.0
    for x in (logits, logits[:, 500:2500], logits[::2], logits.double()):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(logits).tolist()[1:6] == [5, 0, 7, 10, 0]
