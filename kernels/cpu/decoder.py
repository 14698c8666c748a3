"""A Llama-family decoder stack run for a batch of decode tokens in one C call (``decoder.c``).

The model builds a ``Decoder`` once its weights are packed. Decode steps go through it, and so do prefill chunks
that are short or not deep into their prompt (``engine/models/llama.py``), each prompt token attending as a decode
query over its prefix; the rest go through the model's modules. For decodes both run the same kernels in the same
order, so their hidden states are bit-identical (tested); this path only drops the per-kernel Python calls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields

import torch

from kernels import kv_int8
from kernels.cpu.bodies import DEFAULT_BODY, Body
from kernels.cpu.formats import WEIGHT_FORMATS, packed_geometry
from kernels.cpu.library import c_float, c_i64, c_int, library, ptr
from kernels.cpu.moe import MoeBlock, MoeStruct
from kernels.cpu.ops import check, kv_format, product_word


@dataclass
class LayerWeights:
    """One layer's tensors: RMSNorm weights, linear weights packed by ``pack_weight`` or ``pack_weight_compact``,
    optional biases, and Qwen3's per-head q/k norms; a mixture-of-experts layer's block in place of gate_up/down."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # A fused projection of two block types (a GGUF file's SplitBlocks): its first ``*_head_rows`` outputs in
    # ``qkv``/``gate_up``, the rest in these panels of another format.
    qkv_tail: torch.Tensor | None = None
    gate_up_tail: torch.Tensor | None = None
    qkv_head_rows: int = 0
    gate_up_head_rows: int = 0
    moe: MoeBlock | None = None


_PACKED = ("qkv", "o", "gate_up", "down", "qkv_tail", "gate_up_tail")
_ROWS = ("qkv_head_rows", "gate_up_head_rows")


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float  # attention's softmax scale


class _LayerStruct(ctypes.Structure):  # struct hp_layer
    _fields_ = [(f.name, ptr) for f in fields(LayerWeights) if f.name not in (*_ROWS, "moe")] + [
        ("k_cache", ptr), ("v_cache", ptr)] + [(f"{name}_format", c_int) for name in _PACKED] + [
        (name, c_int) for name in _ROWS] + [("moe", ctypes.POINTER(MoeStruct))]


class _DecoderStruct(ctypes.Structure):  # struct hp_decoder
    _fields_ = [
        *((name, c_int) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                      "intermediate", "block_size", "kv_format")),
        ("eps", c_float),
        ("scale", c_float),
        ("cos_cache", ptr),
        ("sin_cache", ptr),
        ("final_norm", ptr),
        ("layers", ctypes.POINTER(_LayerStruct)),
    ]


def _library_with_decoder() -> ctypes.CDLL:
    lib = library()
    lib.hp_decode_scratch.argtypes = [ctypes.POINTER(_DecoderStruct)]
    lib.hp_decode_scratch.restype = c_i64
    lib.hp_decode_forward.argtypes = [ctypes.POINTER(_DecoderStruct), ptr, ptr, c_int, ptr, ptr, ptr, c_i64,
                                      ptr, ptr]
    lib.hp_decode_forward.restype = c_int
    return lib


class Decoder:
    """Holds the layers' tensors and their C description; call it with a decode batch (see ``__call__``)."""

    def __init__(
        self,
        shape: DecoderShape,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        cos_cache: torch.Tensor,  # [max_position, head_dim]
        sin_cache: torch.Tensor,
        int8_activations: bool = False,  # block panels multiply int8 activations (cpu.linear's flag)
        body: Body = DEFAULT_BODY,  # the bodies every product runs through (cpu.linear's)
    ) -> None:
        s = shape
        if s.head_dim % 8 or s.num_heads % s.num_kv_heads:
            raise ValueError(f"unsupported heads: {s.num_heads} x {s.head_dim} over {s.num_kv_heads} KV heads")
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self._lib = _library_with_decoder()
        self.shape = shape
        self._tensors = [final_norm, cos_cache, sin_cache]  # kept alive while C holds their pointers
        for name, t in (("final_norm", final_norm), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
            _contiguous(t, name)
        if cos_cache.shape != sin_cache.shape or cos_cache.shape[-1] != s.head_dim:
            raise ValueError(f"rotary tables {tuple(cos_cache.shape)} do not match head_dim {s.head_dim}")
        self._layers = (_LayerStruct * len(layers))()
        for i, layer in enumerate(layers):
            expected = {
                "input_norm": (s.hidden,), "post_norm": (s.hidden,), "q_norm": (s.head_dim,), "k_norm": (s.head_dim,),
                "qkv": (s.hidden, q_size + 2 * kv_size), "o": (q_size, s.hidden),
                "gate_up": (s.hidden, 2 * s.intermediate), "down": (s.intermediate, s.hidden),
                "qkv_bias": (q_size + 2 * kv_size,), "o_bias": (s.hidden,), "gate_up_bias": (2 * s.intermediate,),
                "down_bias": (s.hidden,),
            }
            for fused in ("qkv", "gate_up"):  # split in two: the head's outputs, then the tail's
                head_rows = getattr(layer, f"{fused}_head_rows")
                if (getattr(layer, f"{fused}_tail") is None) != (head_rows == 0):
                    raise ValueError(f"layers[{i}].{fused}: a tail needs its head's rows, and only a tail does")
                if head_rows:
                    k, n = expected[fused]
                    expected[fused], expected[f"{fused}_tail"] = (k, head_rows), (k, n - head_rows)
                    setattr(self._layers[i], f"{fused}_head_rows", head_rows)
            if (layer.moe is None) == (layer.gate_up is None or layer.down is None):
                raise ValueError(f"layers[{i}]: either gate_up and down or a mixture-of-experts block")
            if layer.moe is not None:
                if layer.moe.hidden != s.hidden:
                    raise ValueError(f"layers[{i}].moe: hidden {layer.moe.hidden}, not {s.hidden}")
                self._layers[i].moe = ctypes.pointer(layer.moe.struct)
                self._tensors.append(layer.moe)
            for f in fields(LayerWeights):
                t = getattr(layer, f.name)
                if t is None or f.name in (*_ROWS, "moe"):
                    continue
                name = f"layers[{i}].{f.name}"
                if f.name in _PACKED:  # panels of an (in -> out) weight, in any of WEIGHT_FORMATS
                    k, n = expected[f.name]
                    if t.dtype not in WEIGHT_FORMATS or not t.is_contiguous():
                        raise ValueError(f"{name}: expected contiguous packed panels, got {t.dtype}")
                    if t.dim() != 3 or packed_geometry(t)[0] != k or packed_geometry(t)[1] < n:
                        raise ValueError(f"{name}: packed {tuple(t.shape)} does not hold a {k} -> {n} weight")
                    setattr(self._layers[i], f"{f.name}_format", product_word(t, int8_activations, body))
                else:
                    _contiguous(t, name)
                    if tuple(t.shape) != expected[f.name]:
                        raise ValueError(f"{name}: expected shape {expected[f.name]}, got {tuple(t.shape)}")
                setattr(self._layers[i], f.name, t.data_ptr())
                self._tensors.append(t)
        self._struct = _DecoderStruct(
            num_layers=len(layers), hidden=s.hidden, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, intermediate=s.intermediate, block_size=0, eps=s.eps, scale=s.scale,
            cos_cache=cos_cache.data_ptr(), sin_cache=sin_cache.data_ptr(), final_norm=final_norm.data_ptr(),
            layers=self._layers,
        )
        self._scratch = self._lib.hp_decode_scratch(ctypes.byref(self._struct))
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Points the layers at their K/V pools [num_blocks, block_size, num_kv_heads, head_dim (+ int8 scale)]."""
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self._layers)} layers")
        s = self.shape
        block_size, fmt = kv_caches[0][0].shape[1], kv_format(*kv_caches[0])
        for i, (k, v) in enumerate(kv_caches):
            if kv_format(k, v) != fmt:
                raise ValueError(f"kv_caches[{i}]: {k.dtype}, where layer 0's pools are {kv_caches[0][0].dtype}")
            for name, t in (("k", k), ("v", v)):
                row = kv_int8.row_width(s.head_dim, t.dtype)
                if t.dim() != 4 or t.shape[1:] != (block_size, s.num_kv_heads, row):
                    raise ValueError(f"kv_caches[{i}].{name}: shape {tuple(t.shape)} does not match the model")
            self._layers[i].k_cache, self._layers[i].v_cache = k.data_ptr(), v.data_ptr()
        self._struct.block_size, self._struct.kv_format = block_size, fmt
        self._kv_caches = kv_caches

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] embeddings of the T tokens; clobbered (it carries the residual stream)
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64
        block_tables: torch.Tensor,  # [T, max_num_blocks] int32, rows contiguous
        seq_lens: torch.Tensor,  # [T] int32, context length including this token
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor | None:  # [T, hidden]: the final norm's output; None where a routing tie needs torch's topk
        if kv_caches is not self._kv_caches:
            self._bind(kv_caches)
        num_tokens = x.shape[0]
        _contiguous(x, "x")
        for name, t, dtype in (("positions", positions, torch.int64), ("slot_mapping", slot_mapping, torch.int64),
                               ("seq_lens", seq_lens, torch.int32)):
            check(t, dtype, name)
            if t.shape != (num_tokens,) or not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous [{num_tokens}] tensor, got {tuple(t.shape)}")
        check(block_tables, torch.int32, "block_tables")
        if block_tables.shape[0] != num_tokens or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables: expected {num_tokens} contiguous rows, got {tuple(block_tables.shape)}")
        if x.shape[1] != self.shape.hidden:
            raise ValueError(f"x: expected [T, {self.shape.hidden}], got {tuple(x.shape)}")
        out = torch.empty(num_tokens, self.shape.hidden, dtype=torch.float32)
        scratch = torch.empty(num_tokens * self._scratch, dtype=torch.float32)
        ties = self._lib.hp_decode_forward(
            ctypes.byref(self._struct), x.data_ptr(), out.data_ptr(), num_tokens, positions.data_ptr(),
            slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            scratch.data_ptr(),
        )
        return None if ties else out


def _contiguous(t: torch.Tensor, name: str) -> None:
    check(t, torch.float32, name)
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
