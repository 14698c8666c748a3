"""A linear layer's product over Harpoon's packed panels (``kernels/cpu``), as the CPU backend sets it on a module
(``Linear.kernel``): whole, or a fused projection held in two formats."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels import cpu as cpu_kernels


@dataclass(frozen=True)
class PackedLinear:
    """A linear layer's product over its packed panels (``Linear.kernel``)."""

    packed: torch.Tensor  # [panels, K, P] in one of kernels.cpu.WEIGHT_FORMATS
    out_features: int
    int8_activations: bool = False  # a GGUF file's blocks times int8 activations (--quantized-matmul int8)
    # compact panels' fp32 panels, which products of at least wide_rows rows read instead (fp32_panels.py)
    wide: torch.Tensor | None = None
    wide_rows: int = 0
    body: cpu_kernels.Body = cpu_kernels.DEFAULT_BODY  # the bodies its products run through (start-up's plan)

    @property
    def parts(self) -> tuple[PackedLinear, ...]:
        return (self,)

    def read(self, wide: bool) -> torch.Tensor:
        """Its fp32 panels where ``wide`` and it has them, else its own: the same bits from either."""
        return self.wide if wide and self.wide is not None else self.packed

    @property
    def word(self) -> int:
        """Its product word (ops.h) over its own panels: format, int8 activations, body."""
        return cpu_kernels.product_word(self.packed, self.int8_activations, self.body)

    def panels(self, rows: int) -> torch.Tensor:
        """The panels a product of ``rows`` rows reads."""
        return self.read(rows >= self.wide_rows)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_kernels.linear(x, self.panels(x.shape[0]), self.out_features, bias, self.int8_activations,
                                  body=self.body)


@dataclass(frozen=True)
class SplitLinear:
    """A fused projection held as panels of two formats (a GGUF file's ``SplitBlocks``): each product writes its
    own columns of the one output."""

    head: PackedLinear
    tail: PackedLinear

    @property
    def parts(self) -> tuple[PackedLinear, ...]:
        return self.head, self.tail

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n = self.head.out_features
        y = torch.empty(x.shape[0], n + self.tail.out_features, dtype=torch.float32)
        for part, columns in zip(self.parts, (slice(0, n), slice(n, None)), strict=True):
            cpu_kernels.linear(x, part.panels(x.shape[0]), part.out_features,
                               None if bias is None else bias[columns], part.int8_activations, out=y[:, columns],
                               body=part.body)
        return y


def with_body(kernel: object, body: cpu_kernels.Body) -> object:
    """``kernel`` (a ``PackedLinear`` or ``SplitLinear``) whose products run through ``body``; any other kernel as it
    is (a oneDNN product has no bodies of ours)."""
    if isinstance(kernel, SplitLinear):
        return replace(kernel, head=with_body(kernel.head, body), tail=with_body(kernel.tail, body))
    return replace(kernel, body=body) if isinstance(kernel, PackedLinear) else kernel
