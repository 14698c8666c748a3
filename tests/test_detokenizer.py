"""Incremental detokenization: what streaming emits, token by token."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from engine import detokenizer
from engine.detokenizer import IncrementalDetokenizer


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time, collecting what a stream would emit after each (stable text only)."""
    emitted, sent = [], 0
    for i, token_id in enumerate(token_ids):
        stopped = detok.add([token_id])
        end = detok.stable_text_end(finished=stopped or i == len(token_ids) - 1)
        assert sent <= end <= len(detok.text), "the stream took back text it had sent"
        emitted.append(detok.text[sent:end])
        sent = end
        if stopped:
            break
    return emitted


@pytest.mark.parametrize("text", ["Hi 😀 there, naïve café — 東京 🚀!", "Ünïcödé façade ✓✓", "plain ascii text"])
def test_multibyte_characters_are_never_split(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert len(ids) > 3
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_token_ids=[1, 2, 3])
    pieces = stream(detok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smollm2_tokenizer.decode(ids)


def test_multi_token_stop_string_never_leaks_a_prefix(smollm2_tokenizer):
    text = "The quick brown fox jumps over the lazy dog and keeps running far away."
    ids = smollm2_tokenizer.encode(text)
    stop = "over the lazy"
    assert len(smollm2_tokenizer.encode(stop)) >= 3
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1], stop=(stop,))
    pieces = stream(detok, ids)
    streamed = "".join(pieces)
    assert streamed == text[: text.index(stop)] and detok.stop_reason == stop
    # Nothing emitted at any point was a prefix of the stop string that later had to be taken back.
    assert not any(p.strip() and stop.startswith(p.strip()) for p in pieces)


def test_stop_string_found_across_token_boundaries_and_earliest_wins(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("abc def ghi jkl")
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1], stop=("ghi", "c d"))
    stream(detok, ids)
    assert detok.text == "ab" and detok.stop_reason == "c d"
    kept = IncrementalDetokenizer(smollm2_tokenizer, [1], stop=("ghi", "c d"), include_stop=True)
    stream(kept, ids)
    assert kept.text == "abc d" and kept.stop_reason == "c d"


def test_random_texts_stream_a_whole_decode_cut_at_the_first_stop_to_complete(smollm2_tokenizer):
    """Random texts of multi-byte characters, contractions and spaces, with stop strings cut from them (or absent):
    the stream never takes text back, and it equals decoding the tokens whole, token by token, up to the first
    token whose text holds a stop string, cut where that stop starts (the earliest one if several)."""
    tok, rng = smollm2_tokenizer, random.Random(0)
    words = ["hi", " there", ",", " .", "?", " don't", " 😀", "é", " 東京", "\n", " ,", "'s", " ", "  ", "c d", "😀😀"]
    for _ in range(300):
        ids = tok.encode("".join(rng.choice(words) for _ in range(rng.randint(1, 20))))
        whole = tok.decode(ids)
        starts = [rng.randrange(len(whole)) for _ in range(rng.randint(1, 3))]
        stop = tuple(whole[i : i + rng.randint(1, 5)] if rng.random() < 0.7 else "zz" for i in starts)
        detok = IncrementalDetokenizer(tok, [1, 2], stop=stop)
        streamed = "".join(stream(detok, ids))
        expected = whole
        for k in range(len(ids)):
            text = tok.decode(ids[: k + 1]).rstrip("\ufffd")  # a character still incomplete is not text yet
            hits = [text.find(s) for s in stop if s in text]
            if hits:
                expected = text[: min(hits)]
                break
        assert streamed == detok.text == expected, (stop, whole)


def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's layout, trained here on a few lines: ``▁`` for spaces, bytes for what the vocabulary lacks (so one
    character can span tokens), and the decoder's stripped leading space."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(["the quick brown fox jumps over the lazy dog", "naïve café, don't stop"] * 5,
                                trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    vocab = trained.get_vocab()
    for b in range(256):  # the byte pieces, as Llama 2's vocabulary has them
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    model = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    model.normalizer = normalizer
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["byte-level BPE", "sentencepiece-like"])
def test_the_rust_stream_emits_what_the_python_window_does(smollm2_tokenizer, kind, monkeypatch):
    """Where decoding is the Rust backend's alone, its DecodeStream detokenizes; it must emit the Python window's
    text exactly: random ids (special tokens, characters cut across tokens, prompts that end inside one), both
    ways of treating special tokens, with and without stop strings."""
    tok = smollm2_tokenizer if kind == "byte-level BPE" else sentencepiece_like_tokenizer()
    assert detokenizer.plain_backend(tok) is not None
    rng, vocab = random.Random(1), len(tok)

    def run(prompt: list[int], ids: list[int], skip: bool, stop: tuple[str, ...]) -> tuple[list[str], str | None]:
        detok = IncrementalDetokenizer(tok, prompt, stop=stop, skip_special_tokens=skip)
        return stream(detok, ids), detok.stop_reason

    cut_prompts = 0
    for _ in range(200):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        cut_prompts += tok.decode(prompt[-5:]).endswith("\ufffd")
        skip = rng.random() < 0.5
        stop = (tok.decode(ids[len(ids) // 2 :])[:3],) if rng.random() < 0.3 else ()
        fast = run(prompt, ids, skip, stop)
        with monkeypatch.context() as m:
            m.setattr(detokenizer, "plain_backend", lambda _: None)
            assert run(prompt, ids, skip, stop) == fast, (prompt, ids, skip, stop)
    assert cut_prompts > 0  # the case the stream must not take
