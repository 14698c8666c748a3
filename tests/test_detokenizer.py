"""Incremental detokenization: what streaming emits, token by token."""

import pytest

from engine.detokenizer import IncrementalDetokenizer


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time, collecting what a stream would emit after each (stable text only)."""
    emitted, sent = [], 0
    for i, token_id in enumerate(token_ids):
        stopped = detok.add([token_id])
        end = detok.stable_text_end(finished=stopped or i == len(token_ids) - 1)
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
