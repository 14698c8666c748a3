"""Incremental detokenization and stop strings, shared by the offline API and the server.

Decoding a growing list of ids one token at a time is not a matter of decoding each token alone: byte-level BPE
splits characters across tokens and sentencepiece drops a leading space. We decode a short window that starts a
few tokens back and emit only what it adds, and only once it no longer ends in an unfinished character.
"""

from __future__ import annotations

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

    def add(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            self.ids.append(token_id)
            delta = self._next_delta()
            if delta and self._append_and_check_stop(delta):
                return True
        return False

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
