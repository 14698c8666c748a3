"""What a request may ask of a given engine, checked wherever a request enters: the engine core, and the server
before anything crosses to the engine process (so bad input never touches the KV pool)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from kernels import cdiv


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """``max_tokens=None`` means as many as the context has room for."""
        if params.max_tokens is None:
            return self.max_model_len - num_prompt_tokens
        return params.max_tokens

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError, with a message for the user, if the request can never be served."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if num_prompt >= self.max_model_len:  # first: a long prompt is refused before its entries are read
            raise InvalidRequestError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                                      f"has {num_prompt}, leaving no room for output", "prompt")
        wrong_type = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)]
        if wrong_type:
            raise InvalidRequestError(f"prompt entry {wrong_type[0]!r} is not a token id (an integer)", "prompt")
        for name, ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} token id {bad[0]} is out of range [0, {self.vocab_size})", name)
        max_tokens = self.resolve_max_tokens(num_prompt, params)
        if num_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {num_prompt} "
                f"and max_tokens asks for {max_tokens} more ({num_prompt + max_tokens} in all)", "max_tokens"
            )
        if cdiv(num_prompt + max_tokens, self.block_size) > self.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {num_prompt + max_tokens} tokens of KV cache but the pool holds only "
                f"{self.num_blocks * self.block_size}; raise kv_cache_memory", "max_tokens"
            )
