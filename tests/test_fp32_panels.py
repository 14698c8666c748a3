"""fp32 panels kept beside compact ones (engine/backends/fp32_panels.py): the values the products widen the compact
panels to, so the same bits, logprobs and tokens whichever a step reads; kept only where they fit and where
start-up timed them faster, from the row count it found."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends import fp32_panels
from engine.backends.packed_linear import PackedLinear
from kernels import cpu
from tests.conftest import quick
from tests.test_compact_weights import GRIDS, bits

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs a C compiler")


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("k,n", [(64, 49), (800, 30)])  # 800: more than one KC slice of a panel
def test_compact_panels_widen_to_the_fp32_panels_of_their_weight(grid, k, n):
    w = GRIDS[grid][0](torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.1)
    compact, full = cpu.pack_weight_compact(w), cpu.pack_weight(w)
    assert compact.dtype in cpu.COMPACT_DTYPES
    wide = cpu.widen_panels(compact)
    assert wide.shape == full.shape and torch.equal(wide, full)  # Q4_0's -0.0 is +0.0 in both (the same products)
    x = torch.randn(90, k)
    for rows in (1, 8, 9, 90):  # in registers, then over widened slices
        assert torch.equal(bits(cpu.linear(x[:rows], wide, n)), bits(cpu.linear(x[:rows], compact, n)))


def test_panels_that_are_not_compact_are_not_widened():
    w = torch.randn(30, 64)
    for packed, name in ((cpu.pack_weight(w), "F32"), (cpu.pack_weight_bf16c(w), "BF16C")):
        with pytest.raises(ValueError, match=f"takes compact panels .*, not {name}"):
            cpu.widen_panels(packed)


def test_the_row_count_is_the_fewest_from_which_fp32_panels_won_at_every_larger_one(monkeypatch):
    """Timed from the most rows down, the first loss ends the search: a win below it is not taken."""
    kernel = PackedLinear(cpu.pack_weight_compact(GRIDS["q4"][0](torch.randn(30, 64))), 30)
    kernels = [fp32_panels.with_fp32_panels(kernel)]
    candidates = sorted({cpu.register_rows() + 1, *fp32_panels.CANDIDATE_ROWS})

    def timed(wins: set[int]) -> int:
        def best_in_turns(fns, turns):
            rows = next(iter(fns["fp32"].args[1].values())).shape[0]
            return {"compact": 1.0, "fp32": 0.5 if rows in wins else 2.0}
        monkeypatch.setattr(fp32_panels, "best_in_turns", best_in_turns)
        chosen, seconds = fp32_panels.from_rows(kernels)
        assert all(key.split("@")[0] in ("compact", "fp32") for key in seconds)
        return chosen

    assert timed(set(candidates)) == candidates[0]
    assert timed(set(candidates[1:])) == candidates[1]
    assert timed({candidates[-1], *candidates[:-2]}) == candidates[-1]  # a loss below the most rows
    assert timed(set(candidates[:-1])) == 0  # a loss at the most rows: none kept


def _engine(monkeypatch, rows: int, **options) -> LLM:
    """The default model in fp32, start-up's timing of the fp32 panels overruled: read from ``rows`` on (0: none)."""
    with monkeypatch.context() as patch:
        patch.setattr(fp32_panels, "from_rows", lambda kernels: (rows, {}))
        return LLM(None, **quick(dtype="float32", gemm_kernels="c", **options))


class _Calls:
    """A decoder that counts its calls."""

    def __init__(self, decoder) -> None:
        self.decoder, self.calls = decoder, 0

    def __call__(self, *args):
        self.calls += 1
        return self.decoder(*args)


def test_the_default_model_gives_the_same_logprobs_from_fp32_panels_beside_the_compact(prompt_ids, monkeypatch):
    """Its Q4_1 projections and tied Q8_0 LM head keep their compact panels and gain fp32 ones, which steps of at
    least ``wide_rows`` rows read, in the one-call decoder and in the head; the logprobs are those of the compact
    panels alone, whatever the batch."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    out = {}
    for rows in (9, 0):
        llm = _engine(monkeypatch, rows)
        backend, model = llm.engine.backend, llm.engine.model
        assert backend.wide_rows == rows
        linears = [m for m in model.modules() if isinstance(getattr(m, "kernel", None), PackedLinear)]
        assert len(linears) == 4 * 30 + 1  # every projection and the LM head
        assert all((m.kernel.wide is not None) == (rows > 0) and m.kernel.packed.dtype in cpu.COMPACT_DTYPES
                   for m in linears)
        assert (backend.wide_decoder is not None) == (rows > 0)
        fp32 = sum(fp32_panels.fp32_bytes(m.kernel) for m in linears)
        assert 500 << 20 < fp32 < 520 << 20 and backend.wide_bytes == (fp32 if rows else 0)
        assert llm.engine.memory_ledger.weights > backend.wide_bytes  # counted in the weights
        if rows:
            assert llm.engine.kernel_plan.chosen("fp32 panels beside") == "from 9 rows"
            backend.decoder, backend.wide_decoder = _Calls(backend.decoder), _Calls(backend.wide_decoder)
        outs = llm.generate(prompt_ids, params)  # steps of 8 prompts' decodes (compact) and of prompts (fp32)
        out[rows] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        alone = llm.generate(prompt_ids[:1], params)[0].outputs[0]  # one stream: compact panels only
        assert (alone.token_ids, alone.logprobs) == out[rows][0]
        if rows:
            assert backend.decoder.calls > 0 and backend.wide_decoder.calls > 0
        del llm
    assert out[9] == out[0]


@pytest.mark.parametrize("why", ["too large", "turned off"])
def test_fp32_panels_are_kept_only_where_they_fit_and_are_asked_for(monkeypatch, why):
    if why == "too large":
        monkeypatch.setattr(fp32_panels, "MAX_BYTES", 100 << 20)  # the default model's take 513 MiB
    llm = _engine(monkeypatch, 9, **({"fp32_panels": False} if why == "turned off" else {}))
    backend = llm.engine.backend
    assert backend.wide_rows == 0 and backend.wide_decoder is None and backend.wide_bytes == 0
    assert all(m.kernel.wide is None for m in llm.engine.model.modules()
               if isinstance(getattr(m, "kernel", None), PackedLinear))
    assert llm.engine.memory_ledger.weights < 120 << 20  # the compact panels alone: 110.8 MiB
