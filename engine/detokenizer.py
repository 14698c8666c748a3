"""Incremental detokenization and stop strings, shared by the offline API and the server.

Decoding a growing list of ids one token at a time is not a matter of decoding each token alone: byte-level BPE
splits characters across tokens and sentencepiece drops a leading space. We decode a short window that starts a
few tokens back and emit only what it adds, and only once it no longer ends in an unfinished character. Where the
tokenizer's decode is its Rust backend's alone, the backend's own ``DecodeStream`` runs that same window in Rust:
the server detokenizes every streamed token on its one API thread, and the Python window cost 6.4 us a token
against 1.3 (loadtest/lab/front_end.py).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context, enough for sentencepiece's space handling


class IncrementalDetokenizer:
    """Holds one sequence's text; ``add`` appends new token ids and returns whether a stop string ended it.

    Invariant: ``text`` never contains a stop string; after a stop, it is cut at the start of the match (at its end
    with ``include_stop``: then the stop string that ended it is the text's last part).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop_reason: str | None = None
        # NOTE: a prompt that ends inside a character (token ids cut mid-UTF-8) keeps the Python window: the
        # backend's stream, started on such ids, emits them as the first token's text.
        self._backend = plain_backend(tokenizer)
        self._stream = None
        if self._backend is not None and not self._backend.decode(self.ids, skip_special_tokens).endswith("\ufffd"):
            self._stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            self.ids.append(token_id)
            delta = self._stream_delta(token_id) if self._stream is not None else self._next_delta()
            if delta and self._append_and_check_stop(delta):
                return True
        return False

    def _stream_delta(self, token_id: int) -> str:
        """The backend's step: the window's own algorithm, whose offsets are kept here as the window moves them, so
        that the window can take over where the stream refuses a step (it raises where a window's text does not
        begin with the text before it, as a space-stripping decoder can make it; the window emits that text)."""
        try:
            delta = self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers raises a plain Exception ("Invalid prefix encountered ...")
            self._stream = None
            return self._next_delta()
        if delta is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _next_delta(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def _append_and_check_stop(self, delta: str) -> bool:
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return False
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        self.stop_reason = stop
        return True

    def stable_text_end(self, finished: bool) -> int:
        """How much of ``text`` may be shown while streaming: the tail that could still grow into a stop string is
        held back until the next token settles it."""
        if finished or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self.max_stop_len + 1)


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer behind ``tokenizer`` if decoding is that tokenizer's alone: a fast tokenizer that does not
    clean up spaces afterwards (transformers' clean-up, for WordPiece vocabularies, is Python on the decoded text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend
