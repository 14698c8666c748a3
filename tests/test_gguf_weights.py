"""A GGUF file read directly (engine/gguf_weights.py): per quant type, our decoding equals gguf-py's dequantization,
and the products over the packed blocks equal those over fp32 panels of the same values, bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from engine.gguf_weights import TensorEntry, decode, hf_name, iter_gguf_weights, read, tensor_table, unpermute_rows
from engine.models.quantized import FileBlocks, QuantizedWeight, SplitBlocks, stack
from kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs a C compiler")

# byte offsets of each type's fp16 scales inside a block (random bytes there could be inf or NaN)
F16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
          Q.Q6_K: [208]}
KIND = {Q.Q4_0: "q4", Q.Q4_1: "q4", Q.Q5_0: "q8", Q.Q5_1: "q5", Q.Q8_0: "q8", Q.Q4_K: "q4k", Q.Q5_K: "q5k",
        Q.Q6_K: "q6k"}


def random_blocks(rng: np.random.Generator, kind: Q, rows: int, cols: int) -> np.ndarray:
    """Every bit random but the fp16 scales, which are finite, of both signs, some of them zero."""
    block, size = GGML_QUANT_SIZES[kind]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in F16_AT[kind]:
        scales = (rng.standard_normal(n) * 1e-3).astype(np.float16)
        scales[::7] = 0
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_tensors(tmp_path_factory):
    """One tensor of every supported type, and one of an unsupported type, in a GGUF file read back by gguf-py."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    for kind in F16_AT:
        writer.add_tensor(kind.name, random_blocks(rng, kind, 40, 512), raw_dtype=kind)
    for dtype in (np.float32, np.float16):
        writer.add_tensor(np.dtype(dtype).name, rng.standard_normal((3, 64)).astype(dtype))
    q3 = rng.integers(0, 256, size=(2, GGML_QUANT_SIZES[Q.Q3_K][1]), dtype=np.uint8)
    q3[:, -2:] = 0  # d
    writer.add_tensor("blk.0.attn_q.weight", q3, raw_dtype=Q.Q3_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("kind", list(F16_AT), ids=lambda k: k.name)
def test_each_type_decodes_to_gguf_pys_values(gguf_tensors, kind):
    tensor = gguf_tensors[kind.name]
    ours = decode(tensor)
    assert isinstance(ours, QuantizedWeight) and ours.kind == KIND[kind] and ours.shape == (40, 512)
    reference = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, kind)))
    values = ours.dequantize()
    same_bits = values.view(torch.int32) == reference.view(torch.int32)
    if kind == Q.Q4_0:
        # NOTE: gguf-py computes d (q - 8), a -0.0 where q = 8 and d < 0; the Q4 form's d q - 8 d gives +0.0. No
        # product can tell them apart (every sum starts from +0.0), and every other value has the same bits.
        assert torch.equal(values, reference) and bool(((reference == 0) | same_bits).all())
        assert bool((~same_bits).any())  # such zeros exist in these blocks, so the exception is real
    else:
        assert bool(same_bits.all())
    assert ours.nbytes <= 1.25 * 40 * 512  # the row form holds about the bytes of the panels, never fp32's


@pytest.mark.parametrize("kind", list(F16_AT), ids=lambda k: k.name)
def test_a_cut_of_the_inputs_keeps_their_values(gguf_tensors, kind):
    """A tensor-parallel rank's part of a row-split projection (``QuantizedWeight.columns``): at super-block bounds
    and inside them, where a K-quant is expanded first."""
    weight = decode(gguf_tensors[kind.name])
    whole = weight.dequantize()
    for start, stop in ((256, 512), (32, 96), (0, 480)):
        part = weight.columns(start, stop)
        assert part.shape == (40, stop - start)
        assert torch.equal(part.dequantize().view(torch.int32), whole[:, start:stop].view(torch.int32))
    with pytest.raises(ValueError, match="cannot be cut at inputs 16:64"):
        weight.columns(16, 64)


@pytest.mark.parametrize("name", ["float32", "float16"])
def test_dense_tensors_keep_their_dtype(gguf_tensors, name):
    tensor = gguf_tensors[name]
    ours = decode(tensor)
    assert ours.dtype == getattr(torch, name) and torch.equal(ours.float(), torch.from_numpy(tensor.data).float())


def test_an_unsupported_type_is_refused_naming_the_tensor_and_its_type(gguf_tensors):
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight: GGUF type Q3_K is not supported.*Q6_K"):
        decode(gguf_tensors["blk.0.attn_q.weight"])


@pytest.mark.parametrize("kind", list(F16_AT), ids=lambda k: k.name)
def test_products_over_packed_blocks_equal_those_over_the_dequantized_weight(gguf_tensors, kind):
    weight = decode(gguf_tensors[kind.name])
    dense = weight.dequantize()
    packed = cpu.pack_blocks(weight.kind, weight.values(), weight.d, weight.m, weight.sub)
    reference = cpu.pack_weight(dense)
    assert torch.equal(cpu.widen_panels(packed), reference)  # the fp32 panels kept beside them (fp32_panels.py)
    torch.manual_seed(0)
    for rows in (1, 3, 4, 7, 33):  # in registers (up to 4 rows) and through unpacked slices (more)
        x = torch.randn(rows, 512)
        y = cpu.linear(x, packed, 40)
        assert torch.equal(y, cpu.linear(x, reference, 40))
        torch.testing.assert_close(y, x.double().matmul(dense.double().T).float(), rtol=1e-4, atol=1e-5)
    ids = torch.tensor([0, 39, 17, 17])
    assert torch.equal(cpu.embed_rows(packed, ids, 40), dense[ids])


def int8_test_weight(gguf_tensors, kind) -> QuantizedWeight:
    """The file's tensor of ``kind`` (40 x 512), or for "Q4_K+Q6_K" 20 rows of each fused (Q6M panels)."""
    if kind != "Q4_K+Q6_K":
        return decode(gguf_tensors[kind.name])
    weight = QuantizedWeight.cat([decode(gguf_tensors["Q4_K"]).rows(slice(0, 20)),
                                  decode(gguf_tensors["Q6_K"]).rows(slice(0, 20))])
    assert weight.kind == "q6m"
    return weight


@pytest.mark.skipif(not cpu.q8x_available(), reason="needs u8 x s8 dot products (AVX512-VNNI or AVX-VNNI)")
@pytest.mark.parametrize("kind", [*F16_AT, "Q4_K+Q6_K"], ids=lambda k: getattr(k, "name", k))
def test_int8_activation_products_are_within_their_rounding_of_the_exact_ones(gguf_tensors, kind):
    """``--quantized-matmul int8`` (llama.cpp's way): per 32 inputs the activations are rounded to int8, so each
    product may move by up to half a step (max |x| / 254) per input; measured against a float64 matmul, relative
    to the sum of |x w| it is ~1e-3. Other panels ignore the flag."""
    weight = int8_test_weight(gguf_tensors, kind)
    packed = cpu.pack_blocks(weight.kind, weight.values(), weight.d, weight.m, weight.sub)
    dense = weight.dequantize().double()
    torch.manual_seed(0)
    for rows in (1, 3, 4, 9, 130):  # 130: two row blocks
        x = torch.randn(rows, 512) * torch.rand(rows, 1) * 10
        ours = cpu.linear(x, packed, 40, int8_activations=True).double()
        reference = x.double() @ dense.T
        bound = (x.abs().double() @ dense.abs().T) / 254  # half an int8 step of each input, times |w|, summed
        assert bool(((ours - reference).abs() <= bound).all())
        assert float(((ours - reference).abs() / (bound * 254)).max()) < 5e-3
    fp32 = cpu.pack_weight(weight.dequantize())
    assert torch.equal(cpu.linear(x, fp32, 40, int8_activations=True), cpu.linear(x, fp32, 40))


@pytest.mark.skipif(not cpu.q8x_available(), reason="needs integer dot products")
@pytest.mark.parametrize("kind", [*F16_AT, "Q4_K+Q6_K"], ids=lambda k: getattr(k, "name", k))
def test_int8_activation_products_of_a_row_do_not_depend_on_its_batch(gguf_tensors, kind):
    """A product takes its rows through different kernel bodies by how many there are (one row alone; groups of
    eight where there are 32 vector registers; groups of four; a narrower last panel), yet each row's outputs have
    the same bits whatever else is in the batch, as the exact products' have."""
    weight = int8_test_weight(gguf_tensors, kind)
    packed = cpu.pack_blocks(weight.kind, weight.values(), weight.d, weight.m, weight.sub)
    torch.manual_seed(0)
    x = torch.randn(21, 512) * torch.rand(21, 1) * 10
    whole = cpu.linear(x, packed, 40, int8_activations=True)
    assert torch.equal(whole, torch.cat([cpu.linear(x[i:i + 1], packed, 40, int8_activations=True)
                                         for i in range(21)]))
    assert torch.equal(whole[3:], cpu.linear(x[3:], packed, 40, int8_activations=True))  # groups begin elsewhere


@pytest.mark.skipif(len(cpu.q8x_dots()) + cpu.q8x_tiles_available() < 2,
                    reason="needs two integer dot products (VNNI, AVX2's maddubs, AMX tiles)")
@pytest.mark.parametrize("kind", [*F16_AT, "Q4_K+Q6_K"], ids=lambda k: getattr(k, "name", k))
def test_every_integer_dot_product_gives_the_same_bits(gguf_tensors, kind):
    """VNNI's u8 x s8 (byte weights offset by 128, taken back off), AVX2's maddubs (signed, with |w| x sign) and,
    where the CPU has them, AMX tiles (16 rows a tile op, signed bytes as they are) sum the same integers exactly and
    fix them up alike, so any may serve: the backend keeps the fastest (timed at start), the tiles from the rows on
    at which they measured faster. The weight is 1024 inputs wide (two k blocks of the panels), and the batches take
    every body, a partial group of 16 rows on the tiles, and reach past a row block (128 rows)."""
    weight = int8_test_weight(gguf_tensors, kind)
    cat = lambda t: None if t is None else torch.cat([t, t.flip(0)], dim=1)  # noqa: E731
    weight = QuantizedWeight(weight.kind, cat(weight.q), cat(weight.d), cat(weight.m), weight.ggml_type,
                             cat(weight.sub))
    packed = cpu.pack_blocks(weight.kind, weight.values(), weight.d, weight.m, weight.sub)
    torch.manual_seed(0)
    x = torch.randn(150, 1024) * torch.rand(150, 1) * 10
    x[0, :32] = 0  # a block of zero activations
    bodies = [(dot, 0) for dot in cpu.q8x_dots()] + ([(cpu.q8x_dots()[0], 1)] if cpu.q8x_tiles_available() else [])
    results = {}
    for dot, tile_rows in bodies:
        body = cpu.Body(int8_dot=dot, int8_tile_rows=tile_rows)
        results[dot, tile_rows] = [cpu.linear(x[:rows], packed, weight.shape[0], int8_activations=True, body=body)
                                   for rows in (1, 3, 9, 16, 21, 150)]
    first, *others = results.values()
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    with pytest.raises(ValueError, match="no 'amx'"):
        cpu.Body(int8_dot="amx")


def test_a_weight_packed_a_chunk_of_panels_at_a_time_gives_the_same_panels(gguf_tensors, monkeypatch):
    import engine.backends.cpu as cpu_backend

    for kind in (Q.Q4_K, Q.Q6_K, Q.Q8_0):
        weight = decode(gguf_tensors[kind.name])
        whole = cpu_backend._pack_quantized(weight)
        monkeypatch.setattr(cpu_backend, "PACK_CHUNK_PANELS", 1)  # 40 rows: panels of 24 and 16 (padded) rows
        assert torch.equal(cpu_backend._pack_quantized(weight), whole)
        monkeypatch.undo()


def file_blocks(tensor) -> FileBlocks:
    """A tensor of the file as the loader holds it, over the bytes gguf-py mapped."""
    return read(TensorEntry(tensor.name, int(tensor.tensor_type), tuple(int(n) for n in reversed(tensor.shape)),
                            int(tensor.data_offset), int(tensor.n_bytes)), np.asarray(tensor.data).reshape(-1))


@pytest.mark.parametrize("kind", list(F16_AT), ids=lambda k: k.name)
def test_panels_packed_from_the_files_bytes_equal_those_of_the_decoded_blocks(gguf_tensors, kind):
    """``gguf_pack.c`` writes the panels from the mapped blocks; rows reordered and stacked (q/k unpermuted, q/k/v
    fused) are only addresses. Both ways give the same bytes, padding columns included."""
    blocks = file_blocks(gguf_tensors[kind.name])
    assert isinstance(blocks, FileBlocks) and blocks.shape == (40, 512)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    for weight in (blocks, blocks.rows(order), blocks.rows(slice(0, 7)), FileBlocks.cat([blocks.rows(order), blocks])):
        decoded = weight.decoded()
        reference = cpu.pack_blocks(decoded.kind, decoded.values(), decoded.d, decoded.m, decoded.sub)
        ours = cpu.pack_gguf_rows(weight.type_id, weight.addresses(), weight.in_features)
        assert ours.dtype == reference.dtype and torch.equal(ours.view(torch.uint8), reference.view(torch.uint8))
    assert torch.equal(blocks.rows(order).decoded().dequantize(), decode(gguf_tensors[kind.name]).dequantize()[order])


@pytest.mark.skipif("amx" not in (cpu.bf16_dots() if cpu.available() else []), reason="the CPU has no AMX tiles")
@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0], ids=lambda k: k.name)
def test_widened_panels_packed_from_the_files_bytes_equal_those_of_the_decoded_blocks(gguf_tensors, kind):
    """Q4A, Q6A and Q8A panels (bfloat16 on AMX) are written from the mapped blocks too, as the decoded blocks
    pack."""
    from engine.backends import amx_blocks

    blocks = file_blocks(gguf_tensors[kind.name])
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    for weight in (blocks, blocks.rows(order), blocks.rows(slice(0, 7))):
        reference, ours = amx_blocks.panels(weight.decoded()), amx_blocks.panels(weight)
        assert ours.dtype == reference.dtype and torch.equal(ours.view(torch.uint8), reference.view(torch.uint8))


def test_shards_stay_in_the_file_in_at_most_two_runs_of_one_type(gguf_tensors):
    """q/k/v of one type stack as addresses; Q4_K q and k before a Q6_K v split into two panels (``SplitBlocks``);
    anything else (three runs) is decoded and widened to one kind (Q6M)."""
    q4_k, q6_k = file_blocks(gguf_tensors["Q4_K"]), file_blocks(gguf_tensors["Q6_K"])
    same = stack([q4_k, q4_k.rows(slice(0, 8))])
    assert isinstance(same, FileBlocks) and same.shape == (48, 512)
    split = stack([q4_k, q4_k.rows(slice(0, 8)), q6_k])
    assert isinstance(split, SplitBlocks) and split.shape == (88, 512) and split.ggml_type == "Q4_K+Q6_K"
    assert split.head.shape == (48, 512) and torch.equal(split.dequantize(), split.decoded().dequantize())
    mixed = stack([q4_k, q6_k, q4_k])
    assert isinstance(mixed, QuantizedWeight) and mixed.kind == "q6m"
    with pytest.raises(ValueError, match="cannot stack"):
        FileBlocks.cat([q4_k, q6_k])


def test_a_split_projection_writes_each_part_into_its_columns(gguf_tensors):
    from engine.backends.cpu import SplitLinear, _quantized_kernel

    split = stack([file_blocks(gguf_tensors["Q4_K"]), file_blocks(gguf_tensors["Q6_K"])])
    kernel = _quantized_kernel(split, int8_activations=False)
    assert isinstance(kernel, SplitLinear)
    whole = cpu.pack_weight(split.dequantize())
    bias = torch.randn(80)
    for rows in (1, 5):
        x = torch.randn(rows, 512)
        assert torch.equal(kernel(x, bias), cpu.linear(x, whole, 80, bias))


def test_a_fused_projection_of_mixed_types_keeps_every_rows_values(gguf_tensors):
    """Q4_K_M gives attn_v Q6_K beside Q4_K q and k in some layers: the fused q/k/v rows go to Q6M panels."""
    parts = [decode(gguf_tensors[name]) for name in ("Q4_K", "Q6_K", "Q8_0")]
    fused = QuantizedWeight.cat(parts)
    assert fused.kind == "q6m" and fused.ggml_type == "Q4_K+Q6_K+Q8_0"
    dense = fused.dequantize()
    assert torch.equal(dense, torch.cat([p.dequantize() for p in parts]))
    packed = cpu.pack_blocks(fused.kind, fused.values(), fused.d, fused.m)
    assert packed.dtype == torch.float64  # the dtype that names Q6M panels
    x = torch.randn(5, 512)
    for rows in (1, 5):
        assert torch.equal(cpu.linear(x[:rows], packed, 120), cpu.linear(x[:rows], cpu.pack_weight(dense), 120))
    q4_q5 = QuantizedWeight.cat([decode(gguf_tensors["Q4_K"]), decode(gguf_tensors["Q5_K"])])
    assert q4_q5.kind == "q5" and torch.equal(q4_q5.dequantize()[:40], parts[0].dequantize())


def test_rows_come_back_in_hugging_faces_order():
    """As transformers' GGUF loader undoes llama.cpp's interleave of each q/k head's rotary halves."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weights = np.arange(8 * 16 * 3).reshape(8 * 16, 3)
    expected = LlamaTensorProcessor(config={})._reverse_permute_weights(weights, 8, 8)
    assert torch.equal(torch.from_numpy(weights)[unpermute_rows(8 * 16, 8)], torch.from_numpy(expected))


def test_gguf_names_map_to_hugging_faces():
    assert hf_name("blk.11.attn_q.weight") == "model.layers.11.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.{}.gate_proj.weight"  # per expert
    assert hf_name("blk.2.ffn_gate_inp.weight") == "model.layers.2.mlp.gate.weight"
    assert hf_name("blk.2.ffn_up_shexp.weight") == "model.layers.2.mlp.shared_expert.up_proj.weight"
    assert hf_name("blk.0.ssm_conv1d.weight") is None


@pytest.mark.parametrize("on_tiles", [False, True], ids=["fmas", "amx-tiles"])
def test_a_k_quant_file_serves_from_its_blocks_with_transformers_logprobs(small_q4_k_m, monkeypatch, on_tiles):
    """A Q4_K_M-mix file (Q4_K, Q6_K output and some attn_v/ffn_down, so a fused q/k/v of mixed types) runs from
    its packed blocks: no dense weight is made, and the prompt logprobs are transformers' (which dequantizes it).
    Where the CPU has AMX, both bodies of the projections (start-up's timing overruled): the block panels' FMAs, and
    the tiles in fp32 (Q4KS and Q6KS panels, test_split_tiles.py), the Q6_K LM head with them."""
    from transformers import AutoModelForCausalLM

    from engine.backends import amx_blocks, fp32_panels
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    if on_tiles and "amx" not in cpu.bf16_dots():
        pytest.skip("the CPU has no AMX tiles")
    monkeypatch.setattr(amx_blocks, "faster", lambda _: on_tiles)
    q4, q6 = ("Q4KS", "Q6KS") if on_tiles else ("Q4K", "Q6K")
    path = small_q4_k_m
    llm = LLM(str(path), max_model_len=256, kv_cache_memory=16 << 20, quantized_matmul="exact")
    model = llm.engine.model
    assert all(p.dim() == 1 or p.numel() == 0 for p in model.parameters())  # norms only: every weight is packed
    formats = {name: cpu.FORMAT_NAMES[m.kernel.packed.dtype] for name, m in model.named_modules()
               if getattr(m, "kernel", None) is not None and hasattr(m.kernel, "packed")}
    # llama.cpp's mix gives layers 0, 3, 6 and 7 of 8 (use_more_bits) a Q6_K attn_v and ffn_down: those q/k/v
    # are Q4K panels for q and k and Q6K panels for v, each product into its own columns
    split = model.layers[3].self_attn.qkv_proj.kernel
    assert (cpu.FORMAT_NAMES[split.head.packed.dtype], cpu.FORMAT_NAMES[split.tail.packed.dtype]) == (q4, q6)
    assert split.head.out_features == 256 + 128 and split.tail.out_features == 128
    assert formats["layers.1.self_attn.qkv_proj"] == q4
    assert formats["layers.0.mlp.down_proj"] == q6 and formats["layers.1.mlp.down_proj"] == q4
    assert formats["lm_head"] == q6 and formats["layers.0.mlp.gate_up_proj"] == q4
    # the blocks stay packed: the ledger's weights are theirs, and the fp32 panels a model this small may keep
    # beside them for steps of many rows (fp32_panels.py, bounded)
    wide = llm.engine.backend.wide_bytes
    assert llm.engine.memory_ledger.weights - wide < 1.25 * path.stat().st_size
    assert wide <= fp32_panels.MAX_BYTES and (wide > 0) == (llm.engine.backend.wide_rows > 0)

    prompts = [[(37 * i + 101 * j) % 49000 + 5 for j in range(6 + 7 * i)] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
        ours = [position[token].logprob for position, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        theirs = [expected[i, token].item() for i, token in enumerate(prompt[1:])]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4


def test_the_kept_tensor_table_reads_the_weights_gguf_py_finds(small_q4_k_m, tmp_path):
    """A later start reads the file through the table kept beside its config, without gguf-py's parse of the
    header: the same tensors, rows and bytes. A file cut short since is refused, naming the tensor."""
    path = str(small_q4_k_m)
    table = tensor_table(GGUFReader(path))
    kept = dict(iter_gguf_weights(path, 4, 2, json.loads(json.dumps(table))))
    parsed = dict(iter_gguf_weights(path, 4, 2))
    assert kept.keys() == parsed.keys() and len(kept) == 8 * 9 + 3
    for name, weight in kept.items():
        other = parsed[name]
        if isinstance(weight, torch.Tensor):
            assert torch.equal(weight, other)
        else:
            assert weight.ggml_type == other.ggml_type and torch.equal(weight.dequantize(), other.dequantize())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_q4_k_m.read_bytes()[:-4096])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor '[\w.]+' runs past the end of the file"):
        list(iter_gguf_weights(str(cut), 4, 2, table))
