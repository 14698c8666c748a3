"""Incremental detokenization: what streaming emits, token by token."""

import random

import pytest

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
