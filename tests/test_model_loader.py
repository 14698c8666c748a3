"""The default model's GGUF file is the authority for its special tokens, whatever transformers' converter says."""

from transformers import AutoTokenizer

from engine.model_loader import (
    default_gguf_path,
    eos_token_ids,
    load_config,
    load_tokenizer,
    resolve_model,
    set_gguf_special_tokens,
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
