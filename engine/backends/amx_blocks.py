"""A GGUF file's blocks kept as blocks in a bfloat16 process on AMX: Q4A, Q6A and Q8A panels
(``kernels/cpu/arch/x86/amx_bf16.c``), which the tile products widen to bfloat16 a k step at a time as they multiply.

Why: made dense for the tiles (BF16A panels), a Q4_K_M file's weights take 2 bytes each where the file holds ~0.6,
and a step reads every one of them. Widened as they are multiplied, the values and so the bits of the products are
those of the BF16A panels of the dequantized weight, in 0.75 bytes a weight (Q4_0, Q4_1, Q4_K: d q + m per 32
inputs), 1 byte (Q6_K: d q per 16) or 1.125 (Q8_0, Q5_0: d q per 32). The widening costs vector work, so start-up
times these panels against BF16A on the first layers and keeps the faster (``timed``, ``faster``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.models.linear import Linear
from engine.models.quantized import FileBlocks, QuantizedWeight, SplitBlocks
from engine.timing import best_in_turns
from kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM
    from engine.models.quantized import Blocks

logger = logging.getLogger(__name__)

# the kind of blocks each widened format holds, and the kind decoded blocks are held as (a K-quant's scales formed);
# which GGUF types go to which format is the format table's (kernels.cpu.gguf_format(type, "tiles"))
FORMAT_KINDS = {"Q4A": "q4", "Q6A": "q6", "Q8A": "q8"}
KINDS = {"q4": "q4", "q4k": "q4", "q6": "q6", "q6k": "q6", "q8": "q8"}
TIMING_BYTES = 1 << 30  # bfloat16 weights over which the widened panels are timed against BF16A

Panels = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a weight's panels, or a SplitBlocks' head's and tail's


def kind_of(blocks: Blocks | None) -> str | None:
    """The kind of blocks ("q4", "q6" or "q8") widened panels hold ``blocks`` as, or None where they cannot; "split"
    for a fused projection of two types, two panels, where each part can be widened."""
    if isinstance(blocks, SplitBlocks):
        head, tail = kind_of(blocks.head), kind_of(blocks.tail)
        return head and tail and "split"
    if isinstance(blocks, QuantizedWeight):
        kind = KINDS.get(blocks.kind)
    else:
        fmt = cpu_kernels.gguf_format(blocks.type_id, "tiles") if isinstance(blocks, FileBlocks) else None
        kind = FORMAT_KINDS[fmt.name] if fmt is not None else None
    return kind if kind and blocks.shape[1] % 32 == 0 else None


def take(model: LlamaForCausalLM) -> dict[Linear, Blocks]:
    """The projections and the LM head whose blocks widened panels can hold, taken out of their layers as they are.
    A tied LM head's embedding keeps its reference to the blocks: where the head is widened, the lookups read its
    panels (``embed_rows``), else the embedding's own blocks are dequantized with the head's."""
    return {m: m.take_quantized() for m in model.modules() if isinstance(m, Linear) and kind_of(m.quantized)}


def panels(blocks: Blocks) -> Panels:
    """``blocks`` decoded and packed as Q4A, Q6A or Q8A panels (each part of a fused projection of two types)."""
    if isinstance(blocks, SplitBlocks):
        return panels(blocks.head), panels(blocks.tail)
    if isinstance(blocks, FileBlocks):  # straight from the file's bytes (gguf_pack.c), the same panels
        return cpu_kernels.pack_gguf_widened(blocks.type_id, blocks.addresses(), blocks.in_features)
    kind = kind_of(blocks)
    decoded = blocks.decoded().widen(kind)
    if kind == "q4":
        return cpu_kernels.pack_weight_q4a(decoded.values(), decoded.d, decoded.m)
    if kind == "q8":
        return cpu_kernels.pack_weight_q8a(decoded.q, decoded.d)
    return cpu_kernels.pack_weight_q6a(decoded.q, decoded.d)


def release(blocks: Blocks) -> None:
    """Hand back the file's pages of ``blocks`` once they are packed (``FileBlocks.release``)."""
    for part in (blocks.head, blocks.tail) if isinstance(blocks, SplitBlocks) else (blocks,):
        if isinstance(part, FileBlocks):
            part.release()


def multiply(packed: Panels, x: torch.Tensor) -> None:
    for part in packed if isinstance(packed, tuple) else (packed,):
        cpu_kernels.linear(x, part, cpu_kernels.packed_geometry(part)[1])


def split_panels(blocks: Blocks) -> Panels:
    """``blocks`` as Q4S, Q6S or Q8S panels: the widened panels' bytes, multiplied in fp32 on AMX
    (``kernels/cpu/arch/x86/amx_bf16.c``); each part of a fused projection of two types. A file's Q4_K and Q6_K
    blocks as Q4KS and Q6KS panels instead: the same products from the file's own scales, in 0.58 and 0.82 bytes a
    weight where Q4S and Q6S take 0.75 and 1 (an 8B Q4_K_M's weights 6.0 GB as Q4S and Q6S, its file 4.9)."""
    if isinstance(blocks, SplitBlocks):
        return split_panels(blocks.head), split_panels(blocks.tail)
    if isinstance(blocks, FileBlocks) and cpu_kernels.gguf_format(blocks.type_id, "tiles-fp32") is not None:
        return cpu_kernels.pack_gguf_ksplit(blocks.type_id, blocks.addresses(), blocks.in_features)
    return cpu_kernels.as_split(panels(blocks))


def timed(model: LlamaForCausalLM, taken: dict[Linear, Blocks], rows: tuple[int, ...],
          rival: tuple[str, Callable[[Blocks], Panels]],
          mine: Callable[[Blocks], Panels] = panels,
          budget: int = TIMING_BYTES) -> tuple[dict[Linear, Panels], dict[str, float]]:
    """``mine`` (the widened panels) of the first layers' projections in ``taken``, and the seconds AMX takes to
    multiply those, and the rival's panels (a name and its packing) the same products, at each of ``rows``, summed
    (the best of turns they take, ``best_in_turns``).
    Over every such projection of as many layers as ``budget`` bytes of bfloat16 hold, as a step streams them. NOTE: the
    saving is in bytes read, which a small working set does not show: on a Xeon whose 2 cores share a large L3, ten
    layers of SmolLM2 timed alike (0.99x) and all thirty 0.78x (docs/history/benchmarks-2026-12.md)."""
    name, pack_rival = rival
    made: dict[Linear, Panels] = {}
    weights: dict[str, list[Panels]] = {"widened": [], name: []}
    size = 0
    for layer in model.layers:
        modules = [m for m in layer.modules() if m in taken]
        if not modules or size >= budget:
            break
        for module in modules:
            made[module] = mine(taken[module])
            size += 2 * taken[module].shape[0] * taken[module].shape[1]
            weights["widened"].append(made[module])
            weights[name].append(pack_rival(taken[module]))
    if not made:
        return {}, {}
    inputs = [{k: torch.randn(m, k) for k in {module.in_features for module in made}} for m in rows]
    seconds = best_in_turns({name: partial(_each, packs, inputs) for name, packs in weights.items()})
    logger.info("GGUF blocks widened on AMX (%d weights, %.0f MiB in bfloat16), ms at %s rows: %s", len(made),
                size / 2**20, " + ".join(map(str, rows)), ", ".join(f"{n} {s * 1000:.2f}" for n, s in seconds.items()))
    return made, seconds


def faster(seconds: dict[str, float]) -> bool:
    """Whether the timing (``timed``) found the widened panels faster than their rival."""
    return bool(seconds) and seconds["widened"] < min(s for n, s in seconds.items() if n != "widened")


def _each(packs: list[Panels], inputs: list[dict[int, torch.Tensor]]) -> None:
    """Every weight's product at each batch of ``inputs`` (by in_features)."""
    for x in inputs:
        for packed in packs:
            part = packed[0] if isinstance(packed, tuple) else packed
            multiply(packed, x[cpu_kernels.packed_geometry(part)[0]])
