"""Embedding models: how a checkpoint says it is one, and how its hidden states become one vector per input.

A checkpoint is served as an embedding model (the engine's pooling runner) when it says so: a sentence-transformers
``modules.json`` with a ``Pooling`` module (Qwen3-Embedding, GTE-Qwen and E5-Mistral ship one), a base-model
architecture without an LM head (``Qwen3Model``, ``LlamaModel``), or a GGUF file's ``pooling_type``; or when the
user asks (``--runner pooling``). The pooling is the checkpoint's: the last token's hidden state, the mean over the
input's tokens, or the first token's (CLS), then L2-normalized where a ``Normalize`` module follows (or, with no
sentence-transformers files, by default, as vLLM's embedding runner does). ``dimensions`` (Matryoshka) cuts a vector
where the config declares it was trained for that (``is_matryoshka`` / ``matryoshka_dimensions``).

The hidden states are the final norm's output, as transformers' ``last_hidden_state`` (engine/pooler.py pools
them). Light: the API process reads a ``PoolingSpec`` too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from engine.model_loader import ModelFiles

POOLING_KINDS = ("last", "mean", "cls")
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                                "pooling_mode_cls_token": "cls"}
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE (0: none, 4: rank)


@dataclass(frozen=True)
class PoolingSpec:
    kind: str  # "last", "mean" or "cls"
    normalize: bool
    hidden_size: int
    matryoshka: bool = False  # ``dimensions`` may cut the vector
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it was trained for, where the config lists them

    def check_dimensions(self, dimensions: int) -> None:
        """Raise ValueError where ``dimensions`` cannot be served."""
        if not self.matryoshka:
            raise ValueError(f"this model was not trained for other sizes (its config says no is_matryoshka): "
                             f"dimensions must be left out or {self.hidden_size}")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}")


def pooling_spec(files: ModelFiles, config: PretrainedConfig, runner: str = "auto") -> PoolingSpec | None:
    """The pooling runner's spec, or None where the model generates. ``runner``: "auto" (as the checkpoint
    says), "pooling" or "generate"."""
    if runner == "generate":
        return None
    modules = _sentence_transformers_pooling(files.path)
    arch = (getattr(config, "architectures", None) or [""])[0]
    base_model = arch.endswith("Model") and not arch.endswith("ForCausalLM")
    gguf_kind = _GGUF_POOLING.get(getattr(config, "gguf_pooling_type", None))
    if runner == "auto" and modules is None and not base_model and gguf_kind is None:
        return None
    kind, normalize = modules if modules is not None else (gguf_kind or "last", True)
    dims = getattr(config, "matryoshka_dimensions", None)
    return PoolingSpec(kind, normalize, config.hidden_size, bool(getattr(config, "is_matryoshka", False) or dims),
                       tuple(int(d) for d in dims) if dims else None)


def _sentence_transformers_pooling(folder: Path) -> tuple[str, bool] | None:
    """(kind, normalize) from a sentence-transformers ``modules.json`` and its Pooling module's config."""
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return None
    config = json.loads((folder / pooling.get("path", "1_Pooling") / "config.json").read_text())
    kinds = [kind for key, kind in _SENTENCE_TRANSFORMERS_MODES.items() if config.get(key)]
    if len(kinds) != 1:
        raise ValueError(f"{folder}: the Pooling module asks for {kinds or 'no mode'}; supported: exactly one of "
                         f"{', '.join(_SENTENCE_TRANSFORMERS_MODES)}")
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    return kinds[0], normalize
