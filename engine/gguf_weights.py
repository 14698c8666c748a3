"""A GGUF file's tensors, read through gguf-py's memory map and handed over as their blocks where they lie.

Why: transformers reads a GGUF file by dequantizing every tensor to fp32, 7 times a Q4_K_M file's bytes, so an 8B
file cannot load in 24 GB. Here a block tensor is a ``FileBlocks`` over the mapping: the CPU backend packs its panels
straight from those bytes (``kernels/cpu/gguf_pack.c``) and hands the pages back at once, so the file is never
resident as a whole beside the weights (it stays in the page cache, not in this process). Where a backend needs the
blocks decoded (a GPU's, or a tensor-parallel cut inside a block row), the decoders below give the row form of
``QuantizedWeight``, one tensor at a time.

Names are mapped to the Hugging Face names ``LlamaForCausalLM.load_weights`` takes, and the q/k rows of the
``llama`` architecture are put back in Hugging Face's order (llama.cpp's converter interleaves each head's two
rotary halves; transformers undoes it the same way).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from functools import partial

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import Q4_K

from engine.gguf_reader import FastGGUFReader
from engine.models.quantized import FileBlocks, QuantizedWeight
from kernels.cpu.pages import drop_pages

Q = GGMLQuantizationType
DENSE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # mixture-of-experts layers (qwen3moe, qwen2moe, and llama with experts: Mixtral)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# an experts tensor [E, rows, cols]: one weight per expert, each the rows of its slice
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's long-context factors; the config carries them (model_loader)


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for names with no such weight.
    An experts tensor's name has ``{}`` where each expert's number goes (``mlp.experts.{}.gate_proj``)."""
    match = _LAYER.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        name = f"mlp.experts.{{}}.{_EXPERTS[part]}" if part in _EXPERTS else _LAYER_NAMES.get(part)
        return None if name is None else f"model.layers.{layer}.{name}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    name = _GLOBAL_NAMES.get(base)
    return None if name is None else f"{name}.{kind}"


def supported_types() -> str:
    return ", ".join(t.name for t in (*DENSE, *_DECODERS))


def _u8(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view of the mapping; every decoder below makes new tensors from it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 scale at byte ``at`` of each block, as fp32 [n]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float().squeeze(1)


def _nibbles(values: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [..., 32] as QuantizedWeight's q4 bytes [..., 16]: input j low, input j + 16 high."""
    return values[..., :16] | (values[..., 16:] << 4)


def _bits(blocks: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """Bit i of the little-endian bytes [at, at + count / 8) of each block, as [n, count] uint8."""
    raw = blocks[:, at:at + count // 8]
    return ((raw.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(len(blocks), count)


def _q4_0(b: torch.Tensor) -> tuple:  # d, 16 bytes: input j low nibble, j + 16 high; w = d (q - 8)
    d = _f16(b, 0)
    return "q4", b[:, 2:18].unsqueeze(1), d, -8 * d, None


def _q4_1(b: torch.Tensor) -> tuple:  # d, m, 16 bytes of nibbles; w = d q + m
    return "q4", b[:, 4:20].unsqueeze(1), _f16(b, 0), _f16(b, 2), None


def _q5_0(b: torch.Tensor) -> tuple:  # d, 4 bytes of high bits, 16 bytes of nibbles; w = d (q - 16)
    low = b[:, 6:22]
    q = torch.cat([low & 15, low >> 4], dim=1) | (_bits(b, 2, 32) << 4)
    return "q8", (q.view(torch.int8) - 16).unsqueeze(1), _f16(b, 0), None, None


def _q5_1(b: torch.Tensor) -> tuple:  # d, m, 4 bytes of high bits, 16 bytes of nibbles; w = d q + m
    low = b[:, 8:24]
    q = torch.cat([low & 15, low >> 4], dim=1) | (_bits(b, 4, 32) << 4)
    return "q5", q.unsqueeze(1), _f16(b, 0), _f16(b, 2), None


def _q8_0(b: torch.Tensor) -> tuple:  # d, 32 int8; w = d q
    return "q8", b[:, 2:34].contiguous().view(torch.int8).unsqueeze(1), _f16(b, 0), None, None


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K and Q5_K: d [n], dmin [n] and each 32 inputs' 6-bit scale and min [n, 8, 2] (gguf-py unpacks them)."""
    sc, mn = Q4_K.get_scale_min(b[:, 4:16].numpy())
    return _f16(b, 0), _f16(b, 2), torch.from_numpy(np.stack([sc, mn], axis=-1).astype(np.uint8))


def _q4_k(b: torch.Tensor) -> tuple:  # d, dmin, 12 bytes of scales, 128 bytes: 32-byte runs, groups 2j (low), 2j+1
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    values = torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)
    d, dmin, sub = _k_scales(b)
    return "q4k", _nibbles(values), d, dmin, sub


def _q5_k(b: torch.Tensor) -> tuple:  # as Q4_K, with 32 bytes of high bits (bit g of byte i: group g, input i)
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    d, dmin, sub = _k_scales(b)
    return "q5k", low | (high << 4), d, dmin, sub


def _q6_k(b: torch.Tensor) -> tuple:  # 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d; w = d s (q - 32)
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    ql = torch.cat([ql & 15, ql >> 4], dim=2).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = (ql | ((qh & 3).reshape(-1, 8, 32) << 4)).view(torch.int8) - 32
    return "q6k", q, _f16(b, 208), None, b[:, 192:208].contiguous().view(torch.int8)


# GGUF type -> its block decoder: (kind, q [blocks, groups, bytes], d [blocks(, scales)], m or None, sub or None),
# the fields of QuantizedWeight per block
_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k,
             Q.Q6_K: _q6_k}


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor lies in the file: what gguf-py's parse of the header gives, kept (``tensor_table``) so that a
    later start maps the file without parsing it again (a 128k-token vocabulary takes gguf-py ~5 s)."""

    name: str
    type_id: int  # ggml's type number
    shape: tuple[int, ...]  # PyTorch's order: the fastest-moving dimension last
    offset: int  # of its first byte in the file
    n_bytes: int


def tensor_table(reader: GGUFReader) -> dict:
    """The file's architecture and tensors, as JSON can hold them (``TensorEntry`` fields)."""
    return {"architecture": reader.fields["general.architecture"].contents(),
            "tensors": [list(astuple(_entry(t))) for t in reader.tensors]}


def decode(tensor: ReaderTensor) -> QuantizedWeight | torch.Tensor:
    """A tensor of the file: dense types as a new tensor of their dtype, block types as a ``QuantizedWeight``."""
    found = read(_entry(tensor), np.asarray(tensor.data).reshape(-1).view(np.uint8))
    return found.decoded() if isinstance(found, FileBlocks) else found


def _entry(tensor: ReaderTensor) -> TensorEntry:
    return TensorEntry(tensor.name, int(tensor.tensor_type), tuple(int(n) for n in reversed(tensor.shape)),
                       int(tensor.data_offset), int(tensor.n_bytes))


def read(entry: TensorEntry, data: np.ndarray, mapped: bool = False) -> FileBlocks | torch.Tensor:
    """A tensor of the file from its bytes ``data`` (uint8): dense types as a new tensor of their dtype, block types
    as ``FileBlocks`` over those bytes (nothing decoded yet). ``mapped``: ``data`` is of the file's memory map."""
    try:
        kind = GGMLQuantizationType(entry.type_id)
    except ValueError:
        raise ValueError(f"{entry.name}: GGUF type {entry.type_id} is not supported (supported: "
                         f"{supported_types()})") from None
    if kind in DENSE:
        return _u8(data).clone().view(DENSE[kind]).reshape(entry.shape)
    if kind not in _DECODERS:
        raise ValueError(f"{entry.name}: GGUF type {kind.name} is not supported (supported: {supported_types()})")
    *outer, cols = entry.shape
    rows = math.prod(outer)  # an experts tensor's rows: every expert's, one after the other
    raw = _u8(data).reshape(rows, -1)
    return FileBlocks(kind.name, int(kind), cols, (raw,), torch.zeros(rows, dtype=torch.int64), torch.arange(rows),
                      partial(decode_rows, kind, cols), mapped, (entry.offset,))


def decode_rows(kind: GGMLQuantizationType, cols: int, raw: torch.Tensor) -> QuantizedWeight:
    """Rows of a tensor's blocks (uint8 [rows, bytes a row]) as a ``QuantizedWeight``."""
    rows = raw.shape[0]
    name, q, d, m, sub = _DECODERS[kind](raw.reshape(rows * cols // _block_size(kind), -1))
    # per block [blocks, n, *rest] -> per row [rows, blocks a row x n, *rest]
    by_row = lambda t: None if t is None else t.reshape(rows, -1, *t.shape[2:]).contiguous()  # noqa: E731
    return QuantizedWeight(name, by_row(q), by_row(d), by_row(m), kind.name, by_row(sub))


def _block_size(kind: GGMLQuantizationType) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[kind][0]


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's per-head interleave of q/k rows (as transformers' GGUF loader)."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def iter_gguf_weights(path: str, num_heads: int, num_kv_heads: int, table: dict | None = None
                      ) -> Iterator[tuple[str, FileBlocks | torch.Tensor]]:
    """(Hugging Face name, weight) for every weight of the file: block types as ``FileBlocks`` over the file's
    memory map (a backend packs them from there), dense types read as tensors. ``table``: the file's
    ``tensor_table``, where it was kept; else gguf-py parses the header."""
    if table is None:
        table = tensor_table(FastGGUFReader(path))
    arch = table["architecture"]
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, type_id, shape, offset, n_bytes in table["tensors"]:
        entry = TensorEntry(name, type_id, tuple(shape), offset, n_bytes)
        if entry.name == ROPE_FREQS:
            continue
        hf = hf_name(entry.name)
        if hf is None:
            raise ValueError(f"{path}: unexpected tensor {entry.name!r} for a {arch} model")
        if offset + n_bytes > data.shape[0]:
            raise ValueError(f"{path}: tensor {entry.name!r} runs past the end of the file (truncated?)")
        weight = read(entry, data[offset:offset + n_bytes], mapped=True)
        if arch == "llama" and (".attn_q." in entry.name or ".attn_k." in entry.name):
            heads = num_heads if ".attn_q." in entry.name else num_kv_heads
            order = unpermute_rows(weight.shape[0], heads)
            weight = weight.rows(order) if isinstance(weight, FileBlocks) else weight[order]
        if isinstance(weight, torch.Tensor):  # read whole: its pages are done with
            drop_pages(data[offset:].ctypes.data, n_bytes)
        if "{}" in hf:  # an experts tensor: each expert's weight a view of its rows
            experts, rows = shape[0], math.prod(shape[1:-1])
            for e in range(experts):
                yield hf.format(e), weight[e] if isinstance(weight, torch.Tensor) \
                    else weight.rows(slice(e * rows, (e + 1) * rows))
        elif hf.endswith("shared_expert_gate.weight"):
            yield hf, weight.view(1, -1)  # llama.cpp writes its one row as a vector
        else:
            yield hf, weight
