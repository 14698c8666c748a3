"""The JSON shapes of OpenAI's completion and chat responses (whole and streamed), and their logprobs."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from engine.output_processor import RequestState
from engine.outputs import PositionLogprobs

# The floor of a logprob in a response. Why: a token a grammar's mask rules out has a logprob of -inf, which JSON
# cannot hold; asked for more top logprobs than the grammar allows tokens, a response had one and failed with a
# 500. vLLM answers such a logprob with the same -9999.0.
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    """``logprob`` as a response holds it: -inf (or NaN) and anything below the floor as ``LOGPROB_FLOOR``."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenText:
    """Decoded text of single tokens, cached: logprobs name tokens by their text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text

    def logprobs(self, token_ids: list[int], entries: list[PositionLogprobs | None], num: int,
                 offset: int) -> dict:
        """{tokens, token_logprobs, top_logprobs, text_offset}; an entry of None (first prompt token) is null."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(json_logprob(entry[token_id].logprob))
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            top.append({self.token_text(t): json_logprob(lp.logprob) for t, lp in ranked
                        if lp.rank <= num or t == token_id})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
               stop_reason: int | str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    chunk_choice = choice


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text

    def logprobs(self, token_ids: list[int], entries: list[PositionLogprobs | None], num: int,
                 offset: int = 0) -> dict:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            content.append({
                **self._token(token_id, entry[token_id].logprob),
                "top_logprobs": [self._token(t, lp.logprob) for t, lp in ranked if lp.rank <= num][:num],
            })
        return {"content": content}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def choice(self, index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
               stop_reason: int | str | None, tool_calls: list[dict] | None = None, reasoning: str | None = None,
               with_reasoning: bool = False) -> dict:
        """``with_reasoning``: the message has a ``reasoning_content`` field (a reasoning parser is on)."""
        message = {"role": "assistant", "content": text}
        if with_reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def chunk_choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                     stop_reason: int | str | None, first: bool = False, tool_calls: list[dict] | None = None,
                     reasoning: str = "") -> dict:
        """A first chunk that opens with tool calls or thinking has content null, as a whole message with only
        calls has."""
        delta: dict = {"content": text} if text else {}
        if first:
            delta = {"role": "assistant", "content": text if text or not (tool_calls or reasoning) else None}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


def usage(prompt_tokens: int, states: list[RequestState], n: int) -> dict:
    """Prompt tokens count once per prompt whatever ``n`` is; ``cached_tokens`` is what the prefix cache held of
    each prompt when its first sample was admitted."""
    completion = sum(len(s.token_ids) for s in states)
    cached = sum(s.num_cached_tokens for s in states if s.index % n == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}
