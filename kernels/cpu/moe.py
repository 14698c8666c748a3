"""A mixture-of-experts block's experts over their packed panels in one C call (``moe.c``), and its description
for the one-call decoder (``decoder.py``), which runs its routing too.

Each product comes with its word (ops.h: the panels' format, the int8-activation flag, the body), so the experts
compute exactly what their ``Linear.kernel`` computes one call at a time.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.formats import packed_geometry
from kernels.cpu.library import c_i64, c_int, library, ptr
from kernels.cpu.ops import check

# (panels, product word): one weight's packed panels and how its product runs
Product = tuple[torch.Tensor, int]


@dataclass
class MoeWeights:
    """One block's router, experts and (Qwen2-MoE) gated shared expert, each as its panels and product word."""

    router: Product  # hidden -> num_experts
    gate_up: list[Product]  # per expert: hidden -> 2 intermediate
    down: list[Product]  # per expert: intermediate -> hidden
    top_k: int
    norm_topk: bool
    intermediate: int
    shared_gate_up: Product | None = None
    shared_down: Product | None = None
    shared_gate: Product | None = None  # hidden -> 1
    shared_intermediate: int = 0


class MoeStruct(ctypes.Structure):  # struct hp_moe (moe.h)
    _fields_ = [("router", ptr), ("gate_up", ptr), ("down", ptr), ("gate_up_format", ptr), ("down_format", ptr),
                ("shared_gate_up", ptr), ("shared_down", ptr), ("shared_gate", ptr),
                *((name, c_int) for name in ("router_format", "shared_gate_up_format", "shared_down_format",
                                              "shared_gate_format", "hidden", "num_experts", "top_k", "norm_topk",
                                              "intermediate", "shared_intermediate", "split"))]


def _library() -> ctypes.CDLL:
    lib = library()
    lib.hp_moe_scratch.argtypes = [ctypes.POINTER(MoeStruct)]
    lib.hp_moe_scratch.restype = c_i64
    lib.hp_moe_experts.argtypes = [ctypes.POINTER(MoeStruct), ptr, c_i64, c_int, ptr, ptr, ptr, c_i64, ptr]
    lib.hp_moe_experts.restype = None
    lib.hp_moe_route.argtypes = [ctypes.POINTER(MoeStruct), ptr, c_i64, c_int, ptr, ptr, ptr]
    lib.hp_moe_route.restype = c_int
    return lib


class MoeBlock:
    """A block's weights described for C (``struct``), their tensors kept alive while C holds their pointers."""

    def __init__(self, w: MoeWeights, split: bool = False) -> None:
        hidden = self._fits(w.router, None, len(w.gate_up), "router")
        if len(w.down) != len(w.gate_up):
            raise ValueError(f"{len(w.gate_up)} experts' gate_up panels, {len(w.down)} down")
        for e, (gate_up, down) in enumerate(zip(w.gate_up, w.down, strict=True)):
            self._fits(gate_up, hidden, 2 * w.intermediate, f"gate_up[{e}]")
            self._fits(down, w.intermediate, hidden, f"down[{e}]")
        shared = (w.shared_gate_up, w.shared_down, w.shared_gate)
        if w.shared_intermediate:
            self._fits(w.shared_gate_up, hidden, 2 * w.shared_intermediate, "shared_gate_up")
            self._fits(w.shared_down, w.shared_intermediate, hidden, "shared_down")
            self._fits(w.shared_gate, hidden, 1, "shared_gate")
        elif any(p is not None for p in shared):
            raise ValueError("shared expert panels without shared_intermediate")
        self._lib, self.weights, self.num_experts, self.hidden = _library(), w, len(w.gate_up), hidden
        pointers = lambda products: torch.tensor([p.data_ptr() for p, _ in products], dtype=torch.int64)  # noqa: E731
        words = lambda products: torch.tensor([word for _, word in products], dtype=torch.int32)  # noqa: E731
        self._arrays = [pointers(w.gate_up), pointers(w.down), words(w.gate_up), words(w.down)]
        pointer = lambda p: None if p is None else p[0].data_ptr()  # noqa: E731
        word = lambda p: 0 if p is None else p[1]  # noqa: E731
        self.struct = MoeStruct(
            router=w.router[0].data_ptr(), gate_up=self._arrays[0].data_ptr(), down=self._arrays[1].data_ptr(),
            gate_up_format=self._arrays[2].data_ptr(), down_format=self._arrays[3].data_ptr(),
            shared_gate_up=pointer(w.shared_gate_up), shared_down=pointer(w.shared_down),
            shared_gate=pointer(w.shared_gate), router_format=w.router[1],
            shared_gate_up_format=word(w.shared_gate_up), shared_down_format=word(w.shared_down),
            shared_gate_format=word(w.shared_gate),
            hidden=hidden, num_experts=self.num_experts, top_k=w.top_k, norm_topk=int(w.norm_topk),
            intermediate=w.intermediate, shared_intermediate=w.shared_intermediate, split=int(split),
        )
        self.scratch = self._lib.hp_moe_scratch(ctypes.byref(self.struct))

    @property
    def split(self) -> bool:
        return bool(self.struct.split)

    @split.setter
    def split(self, value: bool) -> None:
        self.struct.split = int(value)

    @staticmethod
    def _fits(product: Product, inputs: int | None, outputs: int, name: str) -> int:
        panels, word = product
        k, n = packed_geometry(panels)
        if not panels.is_contiguous() or (inputs is not None and k != inputs) or n < outputs:
            raise ValueError(f"{name}: packed {tuple(panels.shape)} does not hold a {inputs} -> {outputs} weight")
        return k

    def experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: each token's chosen experts (``experts`` [T, top_k], ``weights`` [T, top_k]) weighted and
        summed in ascending expert order, plus the gated shared expert where the block has one."""
        check(x, torch.float32, "x")
        t, k = experts.shape
        if x.shape != (t, self.hidden) or x.stride(1) != 1 or k != self.weights.top_k:
            raise ValueError(f"x {tuple(x.shape)} and experts {tuple(experts.shape)} do not fit this block")
        experts = experts.to(torch.int32).contiguous()
        if t and (int(experts.min()) < 0 or int(experts.max()) >= self.num_experts):
            raise ValueError(f"experts: ids must lie in 0..{self.num_experts - 1}")
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(t, self.hidden, dtype=torch.float32)
        scratch = torch.empty(t * self.scratch, dtype=torch.float32)
        if t:
            self._lib.hp_moe_experts(ctypes.byref(self.struct), x.data_ptr(), x.stride(0), t, experts.data_ptr(),
                                     weights.data_ptr(), out.data_ptr(), out.stride(0), scratch.data_ptr())
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(experts [T, top_k] int32, weights [T, top_k], ties) as the C decoder routes: the top k by probability,
        ascending index among equals; ``ties`` counts the tokens whose k-th place was a tie."""
        check(x, torch.float32, "x")
        x = x.contiguous()
        t, k = x.shape[0], self.weights.top_k
        experts, weights = torch.empty(t, k, dtype=torch.int32), torch.empty(t, k, dtype=torch.float32)
        scratch = torch.empty(max(t, 1) * self.scratch, dtype=torch.float32)
        ties = self._lib.hp_moe_route(ctypes.byref(self.struct), x.data_ptr(), x.stride(0), t, experts.data_ptr(),
                                      weights.data_ptr(), scratch.data_ptr()) if t else 0
        return experts, weights, ties
