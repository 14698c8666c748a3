"""bfloat16 on a CPU: BF16C panels (``kernels/cpu``), the start-up GEMM plan, ``--dtype auto``, and the engine's
greedy agreement with transformers in bfloat16.

A BF16C product rounds the activations to bfloat16 and sums the products in fp32, so a row's result depends on its
own values only (never on the other rows of the step), and the avx512_bf16 body and its portable twin give the
same bits. AMX tiles sum in their own order and precision: other bits, within the same bound, and again the same
for a row whatever the batch. The engine keeps everything between products in fp32 where transformers in bfloat16
rounds every activation, so the two agree token for token until a near tie, and the rate at which they do is
measured here."""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels import cdiv, cpu
from tests.conftest import greedy_agreement, hf_greedy, quick

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs a C compiler for kernels/cpu")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product of the bfloat16-rounded operands, in float64."""
    return (x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T).float()


BODIES = cpu.bf16_dots() if cpu.available() else []  # the FMAs; avx512_bf16's dot product and AMX tiles if present


@pytest.fixture(params=BODIES)
def body(request):
    """Each body that can compute BF16C products here, as the products' ``Body``."""
    return cpu.Body(bf16=request.param)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64, 130])
@pytest.mark.parametrize("n,k", [(5, 64), (48, 576), (200, 1536), (30, 70)])
def test_bf16c_product_is_the_rounded_operands_product(m, n, k, body):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    y = cpu.linear(x, cpu.pack_weight_bf16c(w), n, bias, body=body)
    # fp32 sums of exact products (a bf16 x bf16 product fits fp32): a few ulps of the sum of magnitudes
    bound = 1e-6 * k**0.5 * (x.to(torch.bfloat16).double().abs() @ w.to(torch.bfloat16).double().abs().T).float()
    assert torch.all((y - bias - reference(x, w)).abs() <= bound + 1e-6)


def test_bf16c_rows_do_not_depend_on_the_other_rows(body):
    gen = torch.Generator().manual_seed(3)
    w = cpu.pack_weight_bf16c(torch.randn(100, 576, generator=gen) / 24)
    x = torch.randn(150, 576, generator=gen)
    x[3, :4] = torch.tensor([float("nan"), 1e-40, float("inf"), -3.4e38])
    bias = torch.randn(100, generator=gen)
    whole = cpu.linear(x, w, 100, bias, body=body)
    for lo, hi in ((0, 1), (5, 6), (7, 30), (16, 32), (64, 150), (149, 150), (0, 150)):
        part = cpu.linear(x[lo:hi], w, 100, bias, body=body)
        assert torch.equal(part.view(torch.int32), whole[lo:hi].view(torch.int32)), (body, lo, hi)


def test_a_body_this_build_lacks_is_refused_and_bodies_travel_with_each_call():
    with pytest.raises(ValueError, match="no 'tiles' bf16 body"):
        cpu.Body(bf16="tiles")
    if "amx" not in BODIES:
        with pytest.raises(ValueError, match="no 'amx' bf16 body"):
            cpu.Body(bf16="amx")
    if not cpu.q8x_tiles_available():
        with pytest.raises(ValueError, match="no AMX tiles for the int8 products"):
            cpu.Body(int8_tile_rows=16)
    # each field its own bits of the product word; the default body none
    words = [cpu.Body(bf16=b).word() for b in BODIES]
    assert cpu.DEFAULT_BODY.word() == 0 and len(set(words)) == len(words) and 0 not in words


@pytest.mark.skipif("dpbf16" not in BODIES, reason="the CPU has no avx512_bf16")
def test_avx512_bf16_and_the_portable_body_give_the_same_bits():
    gen = torch.Generator().manual_seed(4)
    w = cpu.pack_weight_bf16c(torch.randn(200, 1536, generator=gen) / 40)
    x = torch.randn(70, 1536, generator=gen) * 3
    x[0, :7] = torch.tensor([1e-40, -0.0, 3.4e38, 1.0 + 2**-9, 1.0 + 3 * 2**-9, float("inf"), -1e-39])
    native = cpu.linear(x, w, 200, body=cpu.Body(bf16="dpbf16"))
    emulated = cpu.linear(x, w, 200, body=cpu.Body(bf16="fma"))
    assert torch.equal(native.view(torch.int32), emulated.view(torch.int32))


@pytest.mark.parametrize("n", [1, 48, 100])
@pytest.mark.parametrize("width", ["bf16c", "bf16a"])
def test_bf16_panels_hold_each_columns_pairs_of_inputs_and_zeros_past_the_last(n, width):
    """Every bit of the weight, NaNs and infinities among them, in its place (BF16A's 32 columns a panel through the
    same packing, whether or not this CPU has the AMX tiles that compute them)."""
    bits = torch.randint(-2**15, 2**15, (n, 64), dtype=torch.int16, generator=torch.Generator().manual_seed(n))
    w = bits.view(torch.bfloat16)
    width = cpu.panel_width() if width == "bf16c" else cpu.TILE_WIDTH
    panels = cpu.packing._bf16_pairs(w, width, torch.int16).view(-1, 32, width, 2)  # [panel, k // 2, column, k % 2]
    padded = torch.zeros(panels.shape[0] * width, 64, dtype=torch.int16)
    padded[:n] = bits
    assert torch.equal(panels, padded.view(-1, width, 32, 2).transpose(1, 2))
    if width == cpu.panel_width():
        assert torch.equal(cpu.pack_weight_bf16c(w), panels.view(-1, 64, width))


def test_bf16c_panels_need_an_even_in_features():
    with pytest.raises(ValueError, match="even in_features"):
        cpu.pack_weight_bf16c(torch.randn(4, 7))


def test_dtype_auto_picks_bfloat16_only_for_a_bfloat16_checkpoint_measured_faster(monkeypatch):
    from transformers import LlamaConfig

    import engine.backends as backends

    cpu_dev = torch.device("cpu")
    config = EngineConfig()
    speedup = {"value": 2.0}
    monkeypatch.setattr(backends, "bf16_speedup", lambda: speedup["value"])
    assert backends.resolve_dtype(config, cpu_dev, LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    assert backends.resolve_dtype(config, cpu_dev, LlamaConfig(dtype="float32")) == torch.float32
    assert backends.resolve_dtype(config, cpu_dev, LlamaConfig()) == torch.float32  # no dtype saved
    speedup["value"] = 1.1  # emulated bfloat16 products: not worth their rounding
    assert backends.resolve_dtype(config, cpu_dev, LlamaConfig(dtype="bfloat16")) == torch.float32
    assert backends.resolve_dtype(EngineConfig(dtype="bfloat16"), cpu_dev, LlamaConfig()) == torch.bfloat16
    assert backends.resolve_dtype(config, torch.device("cuda"), LlamaConfig()) == torch.bfloat16


def test_bf16_speedup_is_measured_against_fp32_panels():
    from engine.backends.gemm_plan import bf16_speedup

    value = bf16_speedup()
    assert 0.05 < value < 50  # a ratio of two timings; which side wins is the machine's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_library_plan_runs_every_product_through_onednn(dtype, tiny_model, monkeypatch):
    """Where oneDNN measures faster (or the user asks for it), every projection and the head run there, prepacked.
    fp32 stays token-exact with transformers. In bfloat16, oneDNN sums the fp32 products of the same rounded
    operands as the BF16C panels and then rounds its output to bfloat16: the C panels' products, rounded so too (and
    run through the modules, not the one-call decoder, and their logits written, not argmaxed as they come), give its
    prompt logprobs bit for bit."""
    from transformers import AutoModelForCausalLM

    import engine.backends.cpu as cpu_backend
    import engine.backends.gemm_plan as gemm_plan

    if not gemm_plan.library_available(getattr(torch, dtype)):
        pytest.skip(f"torch has no oneDNN linear for {dtype} on this CPU")
    folder = tiny_model("llama-gqa-tied")
    prompts = [[(5 * i + 11 * j) % 500 + 3 for j in range(3 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0)
    options = dict(attention_backend="cpu", dtype=dtype, kv_cache_memory=4 << 20, max_num_batched_tokens=32)
    if dtype == "bfloat16":
        product = cpu_backend.PackedLinear.__call__
        monkeypatch.setattr(cpu_backend.PackedLinear, "__call__",
                            lambda self, x, bias: product(self, x, bias).to(torch.bfloat16).float())
    c_panels = LLM(str(folder), gemm_kernels="c", **options)
    c_panels.engine.backend.decoder = None
    c_panels.engine.backend.argmax_head = None
    c_outs = c_panels.generate(prompts, params)
    llm = LLM(str(folder), gemm_kernels="onednn", **options)
    backend = llm.engine.backend
    assert backend.plan.uses_library and backend.decoder is None
    assert isinstance(llm.engine.model.lm_head.kernel, gemm_plan.OneDnnLinear)
    outs = llm.generate(prompts, params)
    if dtype == "float32":
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokens = [o.outputs[0].token_ids for o in outs]
        assert tokens == [hf_greedy(hf, p, 12) for p in prompts] == [o.outputs[0].token_ids for o in c_outs]
        diffs = [abs(a[t].logprob - b[t].logprob) for o, c, p in zip(outs, c_outs, prompts, strict=True)
                 for a, b, t in zip(o.prompt_logprobs[1:], c.prompt_logprobs[1:], p[1:], strict=True)]
        # other summation orders. NOTE: once, under a full suite's load, 4e-3 (a bfloat16's rounding, where a
        # 5-run loop reads 0.0 apart): the message names the positions, should it come again
        assert max(diffs) < 1e-4, [(i, round(d, 6)) for i, d in enumerate(diffs) if d >= 1e-4]
    else:
        assert [o.prompt_logprobs for o in outs] == [o.prompt_logprobs for o in c_outs]
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in c_outs]


def test_the_gemm_plan_is_one_family_and_reports_its_rates(tiny_model):
    engine = EngineCore(EngineConfig(model=str(tiny_model("qwen2-bias")), attention_backend="cpu",
                                     kv_cache_memory=4 << 20))
    plan = engine.backend.plan
    assert len(set(plan.choice)) == 1 and plan.buckets == (1, 4, 16, 64, 256)
    assert all(len(rates) == len(plan.buckets) and min(rates) > 0 for rates in plan.gflops.values())
    assert plan.peak_gflops is None and plan.kernel_for(1) == plan.kernel_for(10_000) == plan.choice[0]
    engine.backend.after_start_up()  # what a server's engine process does once started
    assert engine.backend.plan.peak_gflops > 0 and engine.backend.plan.as_dict()["peak_gflops"] > 0
    info = plan.as_dict()
    assert info["isa"] == plan.isa and info["dtype"] == "float32"
    with pytest.raises(ValueError, match="gemm_kernels must be auto, c or onednn"):
        EngineConfig(gemm_kernels="mkl")


@pytest.mark.parametrize("kind", ["int8 dot", "fp32 body"])
def test_a_body_is_timed_again_once_started(kind, monkeypatch, tiny_model, small_q4_k_m):
    """The int8 dot product or fp32 body timed while the API process loads (sharing the cores) is timed again once
    started (a server's engine, ``own_process``), and the second timing decides: the plan and the products follow
    it."""
    from engine.kernel_plan import KernelChoice, PlanRow

    int8 = kind == "int8 dot"
    bodies, field = (cpu.q8x_dots(), "int8_dot") if int8 else (cpu.f32_bodies(), "f32")
    if len(bodies) < 2:
        pytest.skip(f"this CPU has one {kind}")
    picks, decide = [], KernelChoice.decide

    def timing(choice: KernelChoice) -> PlanRow:  # at load the last body, then the first
        if choice.name != kind:
            return decide(choice)
        picks.append(bodies[0] if picks else bodies[-1])
        return PlanRow(kind, picks[-1], {})

    monkeypatch.setattr(KernelChoice, "decide", timing)
    model = str(small_q4_k_m) if int8 else str(tiny_model("qwen2-bias"))
    engine = EngineCore(EngineConfig(model=model, kv_cache_memory=4 << 20, gemm_kernels="c",
                                     quantized_matmul="int8" if int8 else "exact"), own_process=True)
    assert picks == [bodies[-1], bodies[0]] and engine.kernel_plan.chosen(kind) == bodies[0]
    assert getattr(engine.backend.body, field) == bodies[0]
    gate_up = engine.model.layers[0].mlp.gate_up_proj.kernel
    assert all(getattr(part.body, field) == bodies[0] for part in gate_up.parts)


def test_no_fp32_body_is_timed_where_the_projections_run_on_the_tiles(monkeypatch, small_q4_k_m):
    """Split panels (fp32 on AMX tiles) are computed by no fp32 body: timing the bodies on them measured nothing."""
    from engine.backends import amx_blocks

    if "amx" not in cpu.bf16_dots() or len(cpu.f32_bodies()) < 2:
        pytest.skip("needs AMX tiles and two fp32 bodies")
    for on_tiles in (True, False):
        monkeypatch.setattr(amx_blocks, "faster", lambda _, on_tiles=on_tiles: on_tiles)
        engine = EngineCore(EngineConfig(model=str(small_q4_k_m), kv_cache_memory=4 << 20, max_model_len=256))
        assert engine.backend.split_body == ("tiles" if on_tiles else "FMAs")
        assert (engine.kernel_plan.chosen("fp32 body") is None) == on_tiles
        del engine


def test_the_matmul_peak_takes_fewer_rows_where_a_dtypes_products_are_slow(monkeypatch):
    # bfloat16 on an AVX2-only CPU: ~30 ms a row, so five calls of 1024 rows held a server's start for 150 s
    from engine.backends import gemm_plan

    rows, mm = [], torch.mm

    def slow_mm(a, b, **kw):
        rows.append(a.shape[0])
        time.sleep(0.01 * a.shape[0])
        return mm(a, b, **kw)

    monkeypatch.setattr(torch, "mm", slow_mm)
    start = time.perf_counter()
    peak = gemm_plan.matmul_peak_gflops(torch.float32)
    assert 0 < peak < 2 * 2048 * 2048 / 0.01 / 1e9
    assert max(rows) <= 64 and len(rows) >= 2 + gemm_plan.PEAK_MIN_CALLS
    assert time.perf_counter() - start < 4 * gemm_plan.PEAK_BUDGET_S


MAX_NEW = 32


@pytest.fixture(scope="module")
def bf16_llm():
    # NOTE: the C family's one-call decoder attends each prompt token as its own query, so a token's bits do not
    # depend on how its prompt was chunked beside others. Where the plan takes oneDNN, prefill chunks go through
    # torch's SDPA, whose bits do; bfloat16's rounding of the products' inputs can then tip a near tie.
    return LLM(None, **quick(dtype="bfloat16", gemm_kernels="c"))


def test_bf16_greedy_tokens_do_not_depend_on_the_batch(bf16_llm, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    together = [o.outputs[0].token_ids for o in bf16_llm.generate(prompt_ids, params)]
    alone = [bf16_llm.generate([ids], params)[0].outputs[0].token_ids for ids in prompt_ids[::3]]
    assert together[::3] == alone
    bm = bf16_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bf16_llm.engine.backend.dtype == torch.bfloat16


def test_bf16_greedy_agrees_with_transformers_bf16_until_a_near_tie(bf16_llm, smollm2_path, prompt_ids):
    """Measured on the test prompts (docs/history/benchmarks-2026-12.md): where our tokens first differ from
    transformers' in bfloat16, each side's token is among the other's top 5 (a near tie, the two roundings tipping it),
    and most prompts are identical for all 32 tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).eval()
    outs = bf16_llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5))
    refs = [hf_greedy(hf, ids, MAX_NEW) for ids in prompt_ids]
    identical, matched, _ = greedy_agreement(hf, prompt_ids, outs, refs)
    print(f"bfloat16 vs transformers bfloat16: {identical}/{len(prompt_ids)} identical for {MAX_NEW} tokens, "
          f"{matched / (MAX_NEW * len(prompt_ids)):.2f} of tokens before the first divergence")
    assert identical >= len(prompt_ids) // 2


def test_the_library_must_win_across_batch_sizes_not_only_at_the_largest():
    from engine.backends.gemm_plan import LIBRARY_MARGIN, library_speedup

    # this machine's fp32 rates (GFLOP/s at M = 1, 4, 16, 64, 256): oneDNN ahead from 64 rows only
    measured = {"c": [59, 136, 175, 204, 212], "onednn": [36, 105, 179, 212, 226]}
    assert library_speedup(measured) < 1 < LIBRARY_MARGIN
    amx_like = {"c": [59, 136, 175, 204, 212], "onednn": [50, 300, 700, 900, 1000]}
    assert library_speedup(amx_like) > LIBRARY_MARGIN


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
def test_bf16a_panels_give_the_bits_of_bf16c_panels_through_amx():
    """Two whole tiles a panel instead of a tile and a half: each column is summed alike, so the same bits; the
    lookups of a tied embedding read the weight's bfloat16 values back from them."""
    gen = torch.Generator().manual_seed(5)
    w, bias = torch.randn(100, 576, generator=gen) / 24, torch.randn(100, generator=gen)
    wide, narrow = cpu.pack_weight_bf16a(w), cpu.pack_weight_bf16c(w)
    assert wide.shape == (4, 576, 32) and cpu.FORMAT_NAMES[wide.dtype] == "BF16A"
    amx = cpu.Body(bf16="amx")
    for m in (1, 5, 16, 40, 64):
        x = torch.randn(m, 576, generator=gen)
        assert torch.equal(cpu.linear(x, wide, 100, bias, body=amx), cpu.linear(x, narrow, 100, bias, body=amx))
    ids = torch.tensor([0, 31, 32, 99, 7])
    assert torch.equal(cpu.embed_rows(wide, ids, 100), w.bfloat16().float()[ids])
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu.pack_weight_bf16a(torch.randn(8, 48))


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
@pytest.mark.parametrize("n,k", [(1000, 64), (77, 96), (13, 32), (4100, 576)])
def test_the_argmax_of_an_amx_product_is_that_of_its_written_logits(n, k):
    """A greedy LM head on AMX takes each row's argmax as the tiles produce the logits (never written): the same
    products, so the index torch's argmax gives over the written ones, ties (the first), NaN rows (the first NaN)
    and -inf rows included, for BF16A, BF16C and Q4A panels, partial last panels and row groups."""
    from engine.sampler import argmax_rows

    gen = torch.Generator().manual_seed(9)
    w = torch.randn(n, k, generator=gen)
    w[5] = w[3]  # two equal columns: the first wins
    q, d, m = _q4_blocks(n, k, gen)
    panels = {"BF16A": cpu.pack_weight_bf16a(w), "BF16C": cpu.pack_weight_bf16c(w), "Q4A": cpu.pack_weight_q4a(q, d, m)}
    amx = cpu.Body(bf16="amx")
    for name, packed in panels.items():
        for rows in (1, 5, 16, 17, 58, 110):
            x = torch.randn(rows, k, generator=gen)
            if rows >= 5:
                x[1] = 0  # every logit 0: column 0
                x[2, 0] = float("nan")  # every logit NaN: column 0
                x[3, 0] = float("inf")  # inf and -inf, and NaN where the column's weight is 0
                x[4] = x[0]
            expected = argmax_rows(cpu.linear(x, packed, n, body=amx))
            assert torch.equal(cpu.argmax_linear(x, packed, n, body=amx), expected), (name, rows)
    assert cpu.argmax_linear(torch.randn(2, k), cpu.pack_weight(w), n) is None  # fp32 panels: no AMX product


def test_a_greedy_bf16_head_on_amx_gives_the_tokens_of_its_written_logits(tiny_model):
    """Where AMX runs the LM head, greedy steps take their tokens without writing the logits; switched off, the same
    requests through the written logits give the same tokens. Elsewhere there is no such head."""
    llm = LLM(str(tiny_model("llama-gqa-tied")), **quick(attention_backend="cpu", dtype="bfloat16",
                                                         gemm_kernels="c", kv_cache_memory=4 << 20))
    backend = llm.engine.backend
    assert (backend.argmax_head is not None) == (backend.body.bf16 == "amx")
    prompts = [[(7 * i + 13 * j) % 500 + 3 for j in range(2 + 11 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    backend.argmax_head = None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == fused


@pytest.mark.skipif("amx" in BODIES or not cpu.available(), reason="the CPU has AMX tiles")
def test_bf16a_panels_are_refused_without_amx():
    with pytest.raises(ValueError, match="need AMX tiles"):
        cpu.pack_weight_bf16a(torch.randn(32, 64))


def _q4_blocks(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q4_1-like blocks: values 0..15, fp16 d and m (as a GGUF file's), in QuantizedWeight's q4 form."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half().float()
    m = (-8 * d - torch.rand(n, k // 32, generator=gen) * 0.002).half().float()
    return q, d, m


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
@pytest.mark.parametrize("n,k", [(100, 576), (1100, 64), (33, 1536), (1100, 576)])
def test_q4a_panels_give_the_bits_of_bf16a_panels_of_the_dequantized_weight(n, k):
    """AMX widens Q4A panels to bfloat16 tiles as it multiplies (d q + m in fp32, rounded to nearest even): the
    tiles of the dequantized weight's BF16A panels, so the same bits at every batch size, one panel or several a
    task (the next one widened under this one's tile ops)."""
    gen = torch.Generator().manual_seed(n + k)
    q, d, m = _q4_blocks(n, k, gen)
    weight = (d.unsqueeze(-1) * q.float() + m.unsqueeze(-1)).reshape(n, k)  # gguf-py's dequantization, fp32
    widened = cpu.pack_weight_q4a(q, d, m)
    assert widened.numel() == cdiv(n, 32) * 32 * k * 3 // 4  # 0.75 bytes a weight
    _assert_the_bits_of_bf16a(widened, "Q4A", weight, gen)


def _assert_the_bits_of_bf16a(widened: torch.Tensor, name: str, weight: torch.Tensor, gen: torch.Generator) -> None:
    """``widened`` (panels of format ``name``) multiplies with the bits of the BF16A panels of ``weight`` at every
    batch size, and lookups read the fp32 values the tiles round (those of ``weight``)."""
    n, k = weight.shape
    dense = cpu.pack_weight_bf16a(weight)
    assert cpu.FORMAT_NAMES[widened.dtype] == name and cpu.packed_geometry(widened) == (k, cdiv(n, 32) * 32)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 3, 16, 33, 64, 100):
        x = torch.randn(rows, k, generator=gen)
        assert torch.equal(cpu.linear(x, widened, n, bias), cpu.linear(x, dense, n, bias)), rows
    ids = torch.tensor([0, n // 2, n - 1, 1])
    assert torch.equal(cpu.embed_rows(widened, ids, n), weight[ids])


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
@pytest.mark.parametrize("n,k", [(100, 576), (1100, 64), (33, 1536)])
def test_q6a_panels_give_the_bits_of_bf16a_panels_of_the_dequantized_weight(n, k):
    """Q6A panels hold a Q6_K's values (q in -32..31, d per 16 inputs: its fp16 d times an int8 sub-scale) in 1
    byte a weight; widened (d (q + 32) - 32 d, exact) they are the tiles of the dequantized weight's BF16A panels."""
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(-32, 32, (n, k // 32, 32), generator=gen, dtype=torch.int8)
    d = (torch.randn(n, k // 256 + 1, generator=gen) * 1e-3).half().float().repeat_interleave(16, dim=1)[:, :k // 16]
    d = d * torch.randint(-128, 128, (n, k // 16), generator=gen).float()
    weight = (d.view(n, k // 16, 1) * q.view(n, k // 16, 16).float()).reshape(n, k)  # gguf-py's, fp32
    widened = cpu.pack_weight_q6a(q, d)
    assert widened.numel() == cdiv(n, 32) * 32 * k  # 1 byte a weight
    _assert_the_bits_of_bf16a(widened, "Q6A", weight, gen)


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
@pytest.mark.parametrize("n,k", [(100, 576), (1100, 64), (33, 1536)])
def test_q8a_panels_give_the_bits_of_bf16a_panels_of_the_dequantized_weight(n, k):
    """Q8A panels hold Q8_0's (and Q5_0's) blocks, an int8 q and an fp16 d per 32 inputs, in 1.125 bytes a weight;
    widened (d q, exact) they are the tiles of the dequantized weight's BF16A panels."""
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(-128, 128, (n, k // 32, 32), generator=gen, dtype=torch.int8)
    d = (torch.randn(n, k // 32, generator=gen) * 1e-3).half().float()
    weight = (d.unsqueeze(-1) * q.float()).reshape(n, k)
    widened = cpu.pack_weight_q8a(q, d)
    assert widened.numel() == cdiv(n, 32) * 32 * k * 9 // 8  # 1.125 bytes a weight
    _assert_the_bits_of_bf16a(widened, "Q8A", weight, gen)


@pytest.mark.skipif("amx" in BODIES or not cpu.available(), reason="the CPU has AMX tiles")
def test_widened_panels_are_refused_without_amx():
    q, d, m = _q4_blocks(32, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="need AMX tiles"):
        cpu.pack_weight_q4a(q, d, m)
    with pytest.raises(ValueError, match="need AMX tiles"):
        cpu.pack_weight_q6a(torch.zeros(32, 2, 32, dtype=torch.int8), torch.ones(32, 4))
    with pytest.raises(ValueError, match="need AMX tiles"):
        cpu.pack_weight_q8a(torch.zeros(32, 2, 32, dtype=torch.int8), torch.ones(32, 2))


def _widened_and_bf16a_tokens(model: str | None, prompts: list,
                              **options) -> dict[bool, tuple[int, list, torch.Tensor]]:
    """Greedy tokens of ``model`` in bfloat16 on AMX tiles with its GGUF blocks as Q4A/Q6A/Q8A panels (True) and as
    BF16A panels (False), start-up's timings overruled (a small model's may find the vector bodies faster); each
    with the number of weights from widened panels, and the lookups of a few token ids."""
    from engine.backends import amx_blocks as widened_panels
    from engine.kernel_plan import KernelChoice, PlanRow

    decide = KernelChoice.decide

    def amx(choice: KernelChoice) -> PlanRow:
        return PlanRow(choice.name, "amx", {}) if choice.name == "bf16 body" else decide(choice)

    params, out = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), {}
    for widened in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(widened_panels, "faster", lambda _, widened=widened: widened)
            patch.setattr(KernelChoice, "decide", amx)
            llm = LLM(model, **quick(dtype="bfloat16", gemm_kernels="c", **options))
        backend = llm.engine.backend
        assert backend.body.bf16 == "amx", llm.engine.kernel_plan.table()
        ids = torch.tensor([0, 1, 17, 4099, llm.engine.model.config.vocab_size - 1])
        out[widened] = (backend.widened_panels, [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
                        llm.engine.model.embed_tokens(ids))
        del llm
    return out


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
def test_the_default_gguf_gives_the_same_tokens_from_q4a_and_from_bf16a_panels(prompt_ids):
    """The shipped SmolLM2 GGUF's Q4_1 projections in bfloat16 on AMX: kept as Q4A panels where start-up times
    them faster, else dequantized into BF16A panels; its tied Q8_0 LM head likewise Q8A or BF16A, and the lookups
    read whichever it is, rounded to bfloat16 where widened. The same bits, so the same greedy tokens either way."""
    out = _widened_and_bf16a_tokens(None, prompt_ids)
    assert out[True][0] == 4 * 30 + 1 and out[False][0] == 0
    assert out[True][1] == out[False][1]
    assert torch.equal(out[True][2], out[False][2])
    assert torch.equal(out[True][2], out[True][2].bfloat16().float())


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
def test_a_q4_k_m_file_gives_the_same_tokens_from_widened_and_from_bf16a_panels(small_q4_k_m):
    """A Q4_K's scales formed per 32 inputs make Q4_1's blocks (Q4A panels), a Q6_K's per 16 Q6A's; q/k/v where v is
    Q6_K (in layers 0, 3, 6 and 7 of the 8) are a panel of each, and the LM head of its own is Q6A: every weight
    of the file's projections is widened, none dense."""
    out = _widened_and_bf16a_tokens(str(small_q4_k_m), ["Hello there", "Once upon a time, in a land"],
                                    max_model_len=256)
    assert out[True][0] == 4 * 8 + 1 and out[False][0] == 0
    assert out[True][1] == out[False][1]
    assert torch.equal(out[True][2], out[False][2])


def test_a_gguf_embedding_of_its_own_stays_blocks_in_bfloat16(small_q4_k_m):
    """In bfloat16 an untied GGUF embedding is not made a dense table: the lookups read its block panels and round
    the rows to bfloat16, the values the dense table would hold. On the C panels, as other tests here: where the
    start-up plan takes oneDNN the embedding is dense by design, and under a loaded CI run the plan once did."""
    from gguf import GGUFReader

    from engine.gguf_weights import decode

    llm = LLM(str(small_q4_k_m), **quick(dtype="bfloat16", max_model_len=256, gemm_kernels="c"))
    embed = llm.engine.model.embed_tokens
    assert embed.weight.numel() == 0 and embed.kernel is not None
    table = next(t for t in GGUFReader(small_q4_k_m).tensors if t.name == "token_embd.weight")
    ids = torch.tensor([0, 1, 17, 4099, 49159])
    assert torch.equal(embed(ids), decode(table).dequantize(torch.bfloat16)[ids].float())


@pytest.mark.skipif("amx" not in BODIES, reason="the CPU has no AMX tiles")
def test_a_q8_0_file_gives_the_same_tokens_from_widened_and_from_bf16a_panels(tmp_path):
    """A Q8_0 file's weights are Q8A panels (its LM head of its own too): the same tokens as from BF16A panels."""
    from loadtest.models import Shape, write_model

    shape = Shape("llama", 256, 512, 2, 4, 2, 49160, 10000.0, 2048, tied=False)  # vocab: the tokenizer's, padded
    path = write_model(shape, "q8_0", tmp_path / "small-q8_0.gguf", seed=2)
    out = _widened_and_bf16a_tokens(str(path), ["Hello there", "Once upon a time, in a land"], max_model_len=256)
    assert out[True][0] == 4 * 2 + 1 and out[False][0] == 0
    assert out[True][1] == out[False][1]
    assert torch.equal(out[True][2], out[False][2])


def test_a_dtype_onednn_cannot_pack_leaves_it_out_of_the_plan(monkeypatch):
    """oneDNN's bf16 reorder refuses CPUs without AVX-512 or avx_ne_convert: the plan then times the C panels
    alone, and asking for oneDNN is a clear error, not a crash inside torch."""
    import engine.backends.gemm_plan as gemm_plan

    monkeypatch.setattr(gemm_plan, "library_available", lambda dtype=torch.float32: dtype != torch.bfloat16)
    weight = torch.randn(32, 64).bfloat16()
    plan = gemm_plan.measure_plan([weight], lambda w: lambda x: x @ w.float().T, torch.bfloat16)
    assert set(plan.gflops) == {"c"} and set(plan.choice) == {"c"}
    with pytest.raises(ValueError, match="no oneDNN linear .* for torch.bfloat16 on this CPU"):
        gemm_plan.measure_plan([weight], lambda w: lambda x: x @ w.float().T, torch.bfloat16, family="onednn")


def test_a_family_the_user_chose_is_not_timed():
    import engine.backends.gemm_plan as gemm_plan

    def untimed(weight):
        raise AssertionError("a product was packed for timing")

    for family in ("c", "onednn") if gemm_plan.library_available(torch.float32) else ("c",):
        plan = gemm_plan.measure_plan([torch.randn(32, 64)], untimed, torch.float32, family=family)
        assert plan.choice == (family,) * len(plan.buckets) and plan.gflops == {}


@pytest.mark.parametrize(("tiles_ms", "chosen"), [((0.9, 0.5, 0.5), 4), ((1.2, 0.9, 0.5), 16), ((0.9, 1.1, 0.5), 64),
                                                  ((1.2, 1.1, 1.1), 0)])
def test_the_tiles_take_the_int8_products_from_the_rows_they_were_faster_at(monkeypatch, tiles_ms, chosen):
    """Start-up times the AMX tiles against the dot product at 64, 16 and 4 rows (``Q8X_TILE_ROWS``, the most rows
    first, stopping at the first loss; the dot at 1.0 ms each here) and the tiles take the products from the fewest
    rows at which, and at every larger one, they were faster: a win at 4 rows alone, with a loss at 16, does not
    count. Never where they never won."""
    from engine.backends import cpu_bodies
    from engine.backends.packed_linear import PackedLinear

    timings = list(tiles_ms)  # timed from the most rows down
    monkeypatch.setattr(cpu_bodies.cpu_kernels, "q8x_tiles_available", lambda: True)
    monkeypatch.setattr("kernels.cpu.bodies.q8x_tiles_available", lambda: True)  # a Body may name the tiles
    monkeypatch.setattr(cpu_bodies, "best_in_turns", lambda fns, turns: {"dot": 1e-3, "tiles": timings.pop() * 1e-3})
    kernel = PackedLinear(cpu.pack_weight(torch.randn(24, 64)), 24)
    row = cpu_bodies.int8_tiles_choice(kernel, lambda: cpu.DEFAULT_BODY).decide()
    assert row.chosen == str(chosen) and row.name == "int8 tile rows"
    timed = [int(key.split("@")[1]) for key in row.seconds if key.startswith("tiles")]
    assert timed == [64, 16, 4][:len(tiles_ms) - len(timings)]  # the most rows first, none after the first loss


def test_timed_bodies_take_turns_and_each_keeps_its_best(monkeypatch):
    """A clock that only the bodies move: "tiles" is slow through its first calls (the machine busy a moment while
    it alone was timed), "fmas" steady. Timed in turns, tiles' later turns show its real time; each call of a turn
    alternates with the other body's."""
    from engine import timing

    now, calls = [0.0], []

    def body(name: str, times: list[float]):
        def call() -> None:
            calls.append(name)
            k = sum(1 for c in calls if c == name) - 1
            now[0] += times[min(k, len(times) - 1)]
        return call

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    best = timing.best_in_turns({"tiles": body("tiles", [0.2, 0.2, 0.1]), "fmas": body("fmas", [0.15])}, turns=2)
    assert best == pytest.approx({"tiles": 0.1, "fmas": 0.15})
    assert calls == ["tiles", "tiles", "fmas", "fmas", "tiles", "fmas", "tiles", "fmas"]
    assert timing.seconds_per_call(body("one", [0.05]), rounds=3) == pytest.approx(0.05) and calls.count("one") == 4
