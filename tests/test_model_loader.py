"""Where a model's files are read from: the default model's GGUF file is the authority for its special tokens,
whatever transformers' converter says; a config resolved once is read back as it was."""

import dataclasses
import json
import shutil

import pytest
from transformers import AutoTokenizer, PretrainedConfig

from engine.model_loader import (
    ModelFiles,
    _write_folder,
    default_gguf_path,
    eos_token_ids,
    load_config,
    load_tokenizer,
    resolve_model,
    resolved_config_path,
    set_gguf_special_tokens,
    tokenizer_eos_id,
)


def test_special_tokens_are_the_gguf_files(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # what transformers 5.17's converter wrote
    set_gguf_special_tokens(tokenizer, default_gguf_path())
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)


def test_the_default_model_stops_only_at_im_end():
    files = resolve_model(None)
    tokenizer = load_tokenizer(files)
    assert eos_token_ids(files, load_config(files), tokenizer) == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_the_tokenizers_eos_is_read_from_its_files_as_the_tokenizer_has_it(smollm2_path, tmp_path):
    """An engine process starts without building its tokenizer: the EOS it stops at comes from the files, and is
    the one the built tokenizer names; where the files do not name it, the tokenizer is built and asked."""
    files = resolve_model(None)
    assert tokenizer_eos_id(files) == load_tokenizer(files).eos_token_id == 2
    assert eos_token_ids(files, load_config(files)) == eos_token_ids(files, load_config(files), load_tokenizer(files))
    bare = tmp_path / "bare"
    shutil.copytree(files.path, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|endoftext|>"}  # the other form transformers writes
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_eos_id(dataclasses.replace(files, path=bare)) == 0
    del config["eos_token"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_eos_id(dataclasses.replace(files, path=bare)) == load_tokenizer(
        dataclasses.replace(files, path=bare)).eos_token_id


def test_a_cached_folder_made_by_two_processes_at_once_keeps_the_first(tmp_path):
    """A server and a load client started together on a fresh machine both make the default model's metadata
    folder; the one that renames its copy into place second keeps the first's and leaves no temporary folder."""
    folder = tmp_path / "gguf-meta" / "model-key"

    def write_after_the_other_process(tmp):
        (tmp / "config.json").write_text("{}")
        folder.mkdir()  # the other process's rename lands first
        (folder / "config.json").write_text('{"first": true}')

    assert _write_folder(folder, write_after_the_other_process) == folder
    assert json.loads((folder / "config.json").read_text()) == {"first": True}
    assert [p.name for p in folder.parent.iterdir()] == ["model-key"]

    def fails(tmp):
        raise RuntimeError("write failed")

    with pytest.raises(RuntimeError, match="write failed"):
        _write_folder(tmp_path / "other", fails)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_gguf_files_metadata_is_parsed_once_into_the_folder_transformers_alone_makes(tmp_path, monkeypatch):
    """transformers parses a Llama file's header for the config and again for the tokenizer; the folder is made
    from one gguf-py parse and one transformers parse, and holds the very bytes it holds without that sharing."""
    import contextlib

    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from engine import model_loader
    from engine.gguf_reader import FastGGUFReader

    parses, checkpoints = [], []
    build_fields, checkpoint = gguf.GGUFReader._build_fields, gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(gguf.GGUFReader, "_build_fields",
                        lambda self, *a, **k: parses.append(1) or build_fields(self, *a, **k))
    counted = lambda *a, **k: checkpoints.append(1) or checkpoint(*a, **k)  # noqa: E731
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    reader_class = gguf.GGUFReader
    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path / "shared"))
    shared = model_loader.gguf_metadata_folder(default_gguf_path())
    assert (len(parses), len(checkpoints)) == (1, 1)
    assert gguf_utils.load_gguf_checkpoint is counted and gguf.GGUFReader is reader_class  # put back as they were

    parses.clear()
    monkeypatch.setattr(model_loader, "_parsed_once", lambda reader: contextlib.nullcontext())
    # transformers' own parses through the faster reader (the same fields: tests/test_gguf_reader.py); gguf-py's
    # took ~4 s each of them here
    monkeypatch.setattr(gguf, "GGUFReader", FastGGUFReader)
    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path / "alone"))
    alone = model_loader.gguf_metadata_folder(default_gguf_path())
    assert len(parses) == 3
    names = sorted(p.name for p in shared.iterdir())
    assert names == sorted(p.name for p in alone.iterdir()) and "tokenizer.json" in names
    assert all((shared / n).read_bytes() == (alone / n).read_bytes() for n in names)


@pytest.mark.parametrize("kind", ["llama-gqa-tied", "llama-mha-untied-llama3-rope", "mistral", "qwen2-bias",
                                  "qwen3-qknorm"])
def test_a_resolved_config_is_read_back_with_every_value_its_family_class_gave(tiny_model, tmp_path, monkeypatch,
                                                                                kind):
    """Every family's defaults (head_dim, RoPE parameters, layer types, ...) come back from the kept values, in a
    plain PretrainedConfig, whose import leaves out the family classes' (1.0-1.2 s of an engine's start)."""
    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path))
    files = ModelFiles(tiny_model(kind), kind)
    resolved = load_config(files)
    assert type(resolved) is not PretrainedConfig and resolved_config_path(files).exists()
    kept = load_config(files)
    assert type(kept) is PretrainedConfig
    differ = {k for k in vars(resolved).keys() | vars(kept).keys() if vars(resolved).get(k) != vars(kept).get(k)}
    assert differ <= {"use_cache", "transformers_version"}  # neither is read by the engine


def test_a_config_that_cannot_be_kept_is_served_and_leaves_no_half_written_file(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path))
    files = ModelFiles(tiny_model("llama-gqa-tied"), "m")

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("engine.model_loader.os.replace", full_disk)
    assert load_config(files).hidden_size == 64
    assert list((tmp_path / "configs").iterdir()) == []


def test_an_edited_or_cut_short_config_is_resolved_anew(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("llama-gqa-tied"), folder)
    files = ModelFiles(folder, "m")
    load_config(files)
    kept = resolved_config_path(files)
    kept.write_text(kept.read_text()[:40])  # cut short
    assert type(load_config(files)) is not PretrainedConfig  # resolved again, and kept whole again
    assert type(load_config(files)) is PretrainedConfig
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (folder / "config.json").write_text(json.dumps(config))
    assert resolved_config_path(files) != kept
    edited = load_config(files)
    assert type(edited) is not PretrainedConfig and edited.rms_norm_eps == 1e-3


@pytest.mark.parametrize("kind", ["default", "llama-gqa-tied", "mistral", "qwen2-bias", "qwen3-qknorm", "unnamed"])
def test_the_tokenizer_given_the_kept_config_is_the_one_transformers_builds_alone(tiny_model, tmp_path, monkeypatch,
                                                                                 kind):
    """"unnamed": a tokenizer_config.json that names no tokenizer class, which AutoTokenizer then picks by the
    config's class: that one is not given the plain config."""
    if kind == "default":
        files = resolve_model(None)
    elif kind == "unnamed":
        shutil.copytree(tiny_model("qwen2-bias"), tmp_path / "model")
        settings = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
        del settings["tokenizer_class"]
        (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(settings))
        files = ModelFiles(tmp_path / "model", kind)
    else:
        files = ModelFiles(tiny_model(kind), kind)
    monkeypatch.setenv("HARPOON_CACHE", str(tmp_path / "cache"))
    load_config(files)  # kept: the tokenizer is given the plain PretrainedConfig
    ours, alone = load_tokenizer(files), AutoTokenizer.from_pretrained(files.path)
    assert type(load_config(files)) is PretrainedConfig and type(ours) is type(alone)
    assert ours.get_vocab() == alone.get_vocab() and ours.chat_template == alone.chat_template
    assert ours.special_tokens_map == alone.special_tokens_map
    assert ours.added_tokens_decoder == alone.added_tokens_decoder
    text = "Hello <|im_start|>world</s> 1969, naïve café: ∑ x²\n\n"
    assert ours(text).input_ids == alone(text).input_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == alone.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


def test_sampling_defaults_come_from_the_generation_config(tmp_path):
    import json

    from engine.model_loader import ModelFiles, sampling_defaults

    files = ModelFiles(tmp_path, "m")
    assert sampling_defaults(files) == {}  # none written: the API's own
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}))
    assert sampling_defaults(files) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert sampling_defaults(files, "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(files, str(other))
    (other / "generation_config.json").write_text(json.dumps({"temperature": 7.0}))
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults(files, str(other))
