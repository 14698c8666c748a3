"""Models of real sizes with random weights, written as GGUF files, so that tests and benchmarks run 1-8B shapes
with no download. The files go to a cache folder (``$HARPOON_CACHE/random-models``), never into the repository.

    python -m loadtest.models --shape llama-3.2-1b --quant q4_k_m      # prints the file's path
    python -m loadtest.models --shape llama-3.1-8b --quant q8_0 --out /data/llama8b-q8.gguf
    python -m loadtest.models --shape llama-3.2-1b --quant bf16       # a Hugging Face folder of bf16 safetensors
    python -m loadtest.models --shape qwen3-embedding-0.6b --quant bf16   # an embedding model's folder

The quantized blocks are written directly, with random bits and scales chosen so the weights come out around +/-0.05
(gguf-py quantizes Q8_0 and Q4_0 from floats but has no K-quant quantizer, and quantizing 8B floats would need their
32 GB). A ``q4_k_m`` file mixes types as llama.cpp's Q4_K_M does: Q4_K everywhere, Q6_K for the output (a tied
model's token table, which is its output too) and for ``attn_v``/``ffn_down`` in the first and last eighth of the
layers and every third layer between; ``q5_k_m`` likewise, with Q5_K for Q4_K. The tokenizer is the bundled
SmolLM2's (BPE, its merges and chat template), its token list padded up to the shape's vocabulary with plain
tokens and, last, 256 reserved special tokens, as Llama 3's ends. ``bf16`` writes a Hugging Face folder instead
(config, the same tokenizer, weights of N(0, 0.02) in bf16 safetensors, one shard a layer so that no more than a
layer is ever in memory); an embedding shape's folder is a ``Qwen3Model`` without an LM head, with the
sentence-transformers files Qwen3-Embedding ships (last-token pooling, then normalized).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, PoolingType, TokenType
from gguf.constants import GGML_QUANT_SIZES

from engine.gguf_reader import FastGGUFReader

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture: llama, qwen2, qwen3moe
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    context: int
    tied: bool
    qkv_bias: bool = False
    head_dim: int = 0  # where not hidden // heads (Qwen3's 128)
    qk_norm: bool = False
    experts: int = 0  # a mixture of experts: E experts in every layer, k used a token, each of width expert_ff
    experts_used: int = 0
    expert_ff: int = 0
    embedding: bool = False  # an embedding model: a base model without an LM head (bf16 folders only)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, 500000.0, 131072, tied=True),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, 500000.0, 131072, tied=False),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 1000000.0, 32768, tied=False, qkv_bias=True),
    "qwen3-embedding-0.6b": Shape("qwen3", 1024, 3072, 28, 16, 8, 151669, 1000000.0, 32768, tied=True, head_dim=128,
                                  qk_norm=True, embedding=True),
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 6144, 48, 32, 4, 151936, 1000000.0, 40960, tied=False, head_dim=128,
                           qk_norm=True, experts=128, experts_used=8, expert_ff=768),
}
QUANTS = ("q4_k_m", "q5_k_m", "q8_0", "bf16")
RESERVED_SPECIAL = 256  # reserved special tokens at the end of a padded vocabulary, as Llama 3 has


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: GGMLQuantizationType) -> np.ndarray:
    """[rows, bytes per row] of ``kind`` blocks: random quants, and scales that keep the weights within ~0.05."""
    block, size = GGML_QUANT_SIZES[kind]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    f16 = lambda value: np.full(n, value, dtype=np.float16).view(np.uint8).reshape(n, 2)  # noqa: E731
    if kind == Q.Q8_0:  # d, then 32 int8: w = d * q
        raw[:, 0:2] = f16(0.05 / 127)
    elif kind == Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: w = d*sc*q - dmin*m
        raw[:, 0:2] = f16(5e-5)
        raw[:, 2:4] = f16(7.5 * 5e-5)  # centres the nibbles' mean for scales and mins drawn alike
    elif kind == Q.Q5_K:  # as Q4_K, then 32 bytes of fifth bits before the nibbles: q in 0..31
        raw[:, 0:2] = f16(2.5e-5)
        raw[:, 2:4] = f16(15.5 * 2.5e-5)
    elif kind == Q.Q6_K:  # 128 bytes low bits, 64 high bits, 16 int8 scales, then d: w = d * sc * (q - 32)
        raw[:, size - 2:size] = f16(1e-5)
    else:
        raise ValueError(f"no random blocks for {kind.name}")
    return raw.reshape(rows, cols // block * size)


def tensor_types(shape: Shape, quant: str) -> dict[str, GGMLQuantizationType]:
    """The type of each projection (by its GGUF name), as the quantization mix gives it."""
    if quant == "q8_0":
        main, more = Q.Q8_0, Q.Q8_0
    elif quant in ("q4_k_m", "q5_k_m"):
        main, more = Q.Q4_K if quant == "q4_k_m" else Q.Q5_K, Q.Q6_K
    else:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    # llama.cpp gives a table shared with the output the output's type (a Llama-3.2-1B Q4_K_M's is Q6_K)
    types = {"token_embd.weight": more if shape.tied else main}
    if not shape.tied:
        types["output.weight"] = more
    ffn = "_exps" if shape.experts else ""  # llama.cpp gives the experts the types it gives a dense FFN
    for i in range(shape.layers):
        bits = more if use_more_bits(i, shape.layers) else main
        for name in ("attn_q", "attn_k", "attn_output", f"ffn_gate{ffn}", f"ffn_up{ffn}"):
            types[f"blk.{i}.{name}.weight"] = main
        types[f"blk.{i}.attn_v.weight"] = bits
        types[f"blk.{i}.ffn_down{ffn}.weight"] = bits
    return types


# A layer's projections: GGUF's name, and Hugging Face's under ``model.layers.N.``
_PROJECTIONS = (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                ("ffn_down", "mlp.down_proj"))


def _projection_dims(shape: Shape) -> dict[str, tuple[int, ...]]:
    """(rows, cols) of each projection by its GGUF name: rows are the outputs, cols the inputs (ne[1], ne[0]);
    (experts, rows, cols) of an experts tensor."""
    h, i, d = shape.hidden, shape.intermediate, shape.head_size
    q, kv, e, f = shape.heads * d, shape.kv_heads * d, shape.experts, shape.expert_ff
    return {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q), "ffn_gate": (i, h),
            "ffn_up": (i, h), "ffn_down": (h, i), "ffn_gate_exps": (e, f, h), "ffn_up_exps": (e, f, h),
            "ffn_down_exps": (e, h, f)}


def _dims(shape: Shape, name: str) -> tuple[int, ...]:
    """(rows, cols) of a GGUF weight; (experts, rows, cols) of an experts tensor."""
    if name.startswith("blk."):
        return _projection_dims(shape)[name.split(".")[2]]
    return shape.vocab, shape.hidden  # token_embd, output


def _vocabulary(vocab: int) -> tuple[list[str], list[int], Callable[[str], object]]:
    """The bundled tokenizer's tokens and token types padded up to ``vocab``, and its file's fields. The padding is
    plain tokens that no merge reaches, then up to RESERVED_SPECIAL reserved special tokens, as Llama 3's
    vocabulary (128000 plain, 256 special) ends.
    NOTE: all padding was special tokens before: ~100k of them for the 7-8B shapes, which no real file has.
    transformers made each an added token: on the Qwen shape, converting and saving the tokenizer took 6.3 s
    against 4.0 now, and the API process held 0.71 GiB against 0.36-0.48; the load figures measured them."""
    from engine.model_loader import default_gguf_path

    source = FastGGUFReader(default_gguf_path())
    field = lambda key: source.fields[key].contents()  # noqa: E731
    tokens, types = list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.token_type"))
    pad = vocab - len(tokens)
    if pad < 0:
        raise ValueError(f"vocabulary {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    special = min(pad, RESERVED_SPECIAL)
    tokens += [f"<filler_{i}>" for i in range(pad - special)] + [f"<|reserved_special_token_{i}|>"
                                                                 for i in range(special)]
    types += [TokenType.NORMAL] * (pad - special) + [TokenType.CONTROL] * special
    return tokens, types, field


def _tokenizer(writer: GGUFWriter, vocab: int) -> None:
    tokens, types, field = _vocabulary(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(field("tokenizer.ggml.merges")))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_pad_token_id(field("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(field("tokenizer.chat_template"))


def write_model(shape: Shape, quant: str, out: Path, seed: int = 0, name: str = "",
                pooling_type: int | None = None) -> Path:
    """The GGUF file, its tensors made and written one at a time (a 30B-A3B file's 17 GiB never in memory).
    ``pooling_type``: an embedding model's, as llama.cpp numbers them (1 mean, 2 CLS, 3 last token)."""
    rng = np.random.default_rng(seed)
    tmp = out.with_suffix(".partial")
    writer = GGUFWriter(tmp, shape.arch)
    writer.add_name(f"random {name or shape.arch} {quant}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.head_size)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ff)
    writer.add_vocab_size(shape.vocab)
    if pooling_type is not None:
        writer.add_pooling_type(PoolingType(pooling_type))
    writer.add_file_type({"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M}.get(
        quant, LlamaFileType.MOSTLY_Q8_0))
    _tokenizer(writer, shape.vocab)
    makers = []  # per tensor, in the file's order: what makes its data
    for tensor_name, make, raw_dtype in _tensors(shape, quant, rng):
        probe = make(probe=True)
        writer.add_tensor_info(tensor_name, probe.shape, probe.dtype, probe.nbytes, raw_dtype=raw_dtype)
        makers.append(make)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for make in makers:
        writer.write_tensor_data(make())
    writer.close()
    tmp.rename(out)
    return out


def _tensors(shape: Shape, quant: str, rng: np.random.Generator) -> list[tuple[str, Callable, Q | None]]:
    """(name, maker, raw type) of every tensor in the file's order; ``maker(probe=True)`` gives an array of the
    tensor's shape and dtype only (no random bits drawn), ``maker()`` its data."""
    def dense(values: Callable[[], np.ndarray]) -> Callable:
        return lambda probe=False: values()

    def blocks(dims: tuple[int, ...], kind: Q) -> Callable:
        *outer, cols = dims
        rows = int(np.prod(outer))
        size = cols // GGML_QUANT_SIZES[kind][0] * GGML_QUANT_SIZES[kind][1]
        return lambda probe=False: (np.empty((*outer, size), np.uint8) if probe
                                    else random_blocks(rng, rows, cols, kind).reshape(*outer, size))

    norm = lambda n=shape.hidden: dense(lambda: np.ones(n, dtype=np.float32))  # noqa: E731
    dims = _projection_dims(shape)
    made = []
    for name, kind in tensor_types(shape, quant).items():
        if name.startswith("blk.") and name.endswith("attn_q.weight"):
            layer = name.split(".")[1]
            made += [(f"blk.{layer}.attn_norm.weight", norm(), None), (f"blk.{layer}.ffn_norm.weight", norm(), None)]
            if shape.qk_norm:
                made += [(f"blk.{layer}.attn_{p}_norm.weight", norm(shape.head_size), None) for p in "qk"]
            if shape.experts:  # the router: fp32, as llama.cpp keeps it
                made.append((f"blk.{layer}.ffn_gate_inp.weight", dense(
                    lambda: rng.normal(0, 0.02, (shape.experts, shape.hidden)).astype(np.float32)), None))
            if shape.qkv_bias:
                for proj in ("attn_q", "attn_k", "attn_v"):
                    made.append((f"blk.{layer}.{proj}.bias", dense(
                        lambda n=dims[proj][0]: rng.normal(0, 0.02, n).astype(np.float32)), None))
        made.append((name, blocks(_dims(shape, name), kind), kind))
    made.append(("output_norm.weight", norm(), None))
    return made


def _hf_tensors(shape: Shape, layer: int | None) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of one layer's tensors, or (None) of those outside the layers."""
    prefix = "" if shape.embedding else "model."  # a base model's names (Qwen3-Embedding's) have none
    if layer is None:
        names = {f"{prefix}embed_tokens.weight": (shape.vocab, shape.hidden), f"{prefix}norm.weight": (shape.hidden,)}
        if not shape.tied:
            names["lm_head.weight"] = (shape.vocab, shape.hidden)
        return names
    p, dims = f"{prefix}layers.{layer}.", _projection_dims(shape)
    names = {p + "input_layernorm.weight": (shape.hidden,), p + "post_attention_layernorm.weight": (shape.hidden,)}
    names.update({f"{p}{hf}.weight": dims[gguf] for gguf, hf in _PROJECTIONS})
    if shape.qkv_bias:
        names.update({f"{p}{hf}.bias": dims[gguf][:1] for gguf, hf in _PROJECTIONS[:3]})
    if shape.qk_norm:
        names.update({f"{p}self_attn.{n}_norm.weight": (shape.head_size,) for n in "qk"})
    return names


def write_hf_bf16(shape: Shape, out: Path, seed: int = 0) -> Path:
    """A Hugging Face folder of random bf16 weights, written a layer at a time."""
    import torch
    from safetensors.torch import save_file

    from engine.model_loader import default_gguf_path, gguf_to_folder

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for index, layer in enumerate([None, *range(shape.layers)]):
        shard = f"model-{index:05d}-of-{shape.layers + 1:05d}.safetensors"
        tensors = {}
        for name, dims in _hf_tensors(shape, layer).items():
            norm = name.endswith("norm.weight")
            t = torch.ones(dims) if norm else torch.randn(dims, generator=generator) * 0.02
            tensors[name] = t.to(torch.bfloat16)
            weight_map[name] = shard
        save_file(tensors, str(tmp / shard))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    arch = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3")}[shape.arch]
    if shape.embedding:
        arch = ("Qwen3Model", "qwen3")
        _sentence_transformers_files(tmp, shape.hidden)
    config = {"architectures": [arch[0]], "model_type": arch[1], "hidden_size": shape.hidden,
              "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
              "rope_theta": shape.rope_theta, "max_position_embeddings": shape.context, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": shape.tied, "torch_dtype": "bfloat16", "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "head_dim": shape.head_size}
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = gguf_to_folder(default_gguf_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / name).exists():
            (tmp / name).write_bytes((tokenizer / name).read_bytes())
    tmp.rename(out)
    return out


def _sentence_transformers_files(folder: Path, hidden: int) -> None:
    """Qwen3-Embedding's module files: the transformer, last-token pooling, normalization."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=1))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True}, indent=1))
    (folder / "2_Normalize").mkdir(exist_ok=True)


def cached_model(shape_name: str, quant: str, seed: int = 0) -> Path:
    """The file (or for bf16 the folder) for this shape and mix, written once into the cache folder."""
    root = Path(os.environ.get("HARPOON_CACHE", Path.home() / ".cache" / "harpoon")) / "random-models"
    root.mkdir(parents=True, exist_ok=True)
    if quant == "bf16":
        path = root / f"{shape_name}-bf16-seed{seed}"
        return path if path.exists() else write_hf_bf16(SHAPES[shape_name], path, seed)
    path = root / f"{shape_name}-{quant}-seed{seed}.gguf"
    if path.exists() and _is_current(path, SHAPES[shape_name], quant):
        return path
    return write_model(SHAPES[shape_name], quant, path, seed, shape_name)  # anew where an older generator wrote it


def _is_current(path: Path, shape: Shape, quant: str) -> bool:
    """Whether the file has the mix of types and the vocabulary this generator writes now."""
    reader = FastGGUFReader(path)
    if _types_in(reader) != {n: t.name for n, t in tensor_types(shape, quant).items()}:
        return False
    return list(reader.fields["tokenizer.ggml.token_type"].contents()) == _vocabulary(shape.vocab)[1]


def _types_in(reader: FastGGUFReader) -> dict[str, str]:
    """The type of each quantized tensor of a file, by its GGUF name."""
    return {t.name: t.tensor_type.name for t in reader.tensors if t.tensor_type.name != "F32"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--quant", choices=QUANTS, default="q4_k_m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write here instead of the cache folder")
    args = p.parse_args(argv)
    if args.out:
        shape, out = SHAPES[args.shape], Path(args.out)
        path = (write_hf_bf16(shape, out, args.seed) if args.quant == "bf16"
                else write_model(shape, args.quant, out, args.seed, args.shape))
    else:
        path = cached_model(args.shape, args.quant, args.seed)
    size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size
    print(path, f"{size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
