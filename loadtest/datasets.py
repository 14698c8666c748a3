"""Seeded workloads: prompts of a known token length, built with the served model's tokenizer.

    random  fixed input/output lengths (each within +/- range_ratio), ignore_eos so lengths hold
    chat    a chat-like spread: log-normal input and output lengths
    prefix  many requests sharing a long common prefix, each with its own suffix; with num_prefixes > 1, each
            request draws one of that many prefixes (system prompts of different apps, documents under questions),
            the workload that tells a prefix-aware router from round robin
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # as we tokenized it; the server's usage is what gets reported
    output_len: int


def _text_of_length(tokenizer: PreTrainedTokenizerBase, rng: random.Random, length: int, vocab: list[int]) -> str:
    """Random token ids decoded to text, re-fitted until the text encodes back to ``length`` tokens."""
    ids = [rng.choice(vocab) for _ in range(length)]
    for _ in range(8):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == length:
            break
        ids = (again + [rng.choice(vocab) for _ in range(length)])[:length]
    return text


def _vocab(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    special = set(tokenizer.all_special_ids)
    # Plain word pieces only: ids that decode to printable text and survive a round trip on their own.
    return [i for i in range(min(len(tokenizer), 32000)) if i not in special and tokenizer.decode([i]).isprintable()]


def _spread(rng: random.Random, length: int, range_ratio: float) -> int:
    low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def build_requests(kind: str, tokenizer: PreTrainedTokenizerBase, num: int, input_len: int, output_len: int,
                   range_ratio: float, prefix_len: int, seed: int, num_prefixes: int = 1) -> list[BenchRequest]:
    rng = random.Random(seed)
    vocab = _vocab(tokenizer)
    requests = []
    if kind == "random":
        for _ in range(num):
            n_in, n_out = _spread(rng, input_len, range_ratio), _spread(rng, output_len, range_ratio)
            requests.append(BenchRequest(_text_of_length(tokenizer, rng, n_in, vocab), n_in, n_out))
    elif kind == "chat":
        for _ in range(num):
            n_in = int(min(4 * input_len, max(8, rng.lognormvariate(0, 0.8) * input_len)))
            n_out = int(min(4 * output_len, max(4, rng.lognormvariate(0, 0.6) * output_len)))
            requests.append(BenchRequest(_text_of_length(tokenizer, rng, n_in, vocab), n_in, n_out))
    elif kind == "prefix":
        if num_prefixes < 1:
            raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
        prefixes = [_text_of_length(tokenizer, rng, prefix_len, vocab) for _ in range(num_prefixes)]
        for _ in range(num):
            n_in, n_out = _spread(rng, input_len, range_ratio), _spread(rng, output_len, range_ratio)
            suffix = _text_of_length(tokenizer, rng, n_in, vocab)
            prefix = prefixes[0] if num_prefixes == 1 else rng.choice(prefixes)  # one: the draws of before
            requests.append(BenchRequest(prefix + suffix, prefix_len + n_in, n_out))
    else:
        raise ValueError(f"unknown dataset {kind!r}; expected random, chat or prefix")
    return requests
