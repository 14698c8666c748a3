"""Turns a request's prompt (text, token ids or chat messages) into token ids, off the event loop and within bounds.

Tokenizing and chat templating cost time and memory in proportion to the text (a 6 MB prompt once took the API
process to 21 GB and the OOM killer), so both are bounded before they start and run on one worker thread:
- a prompt of more characters than ``max_model_len`` tokens can hold is refused unread. No token of the vocabulary
  spells more than ``longest_token_chars`` characters, so such a text has more tokens than the context;
- what remains is tokenized on the worker (the tokenizer releases the GIL, so streams keep flowing), one request
  at a time, so at most one text of at most ``max_chars`` characters is being tokenized at any moment; a long
  prompt's first ``8 x max_model_len`` characters go first, and a prefix already over the context refuses it;
- token-id prompts longer than the context are refused before their entries are looked at.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from engine.inputs import as_prompt_list
from server.protocol import APIError, ChatMessage, CompletionRequest

# apply_chat_template's own parameters: chat_template_kwargs may not reach them
_TEMPLATE_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}
# A text longer than this many characters per context token is first tokenized in part (encode_prompt); a cut
# prefix can tokenize to a few more tokens than the same span of the whole, hence the margin.
PROBE_CHARS_PER_TOKEN, PROBE_MARGIN_TOKENS = 8, 64
T = TypeVar("T")
CheckChars = Callable[[int, str], None]  # (number of characters, the request field they are in) -> raise if too many


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int]


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of the vocabulary (added tokens included) stands for. A token's raw string
    (byte-level BPE's one character per byte, sentencepiece's pieces) is never shorter than the text it decodes to."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t or "") for t in tokens) + 1  # + 1: a decoded piece may gain the space its marker stood for


class PromptBuilder:
    """Prompt token ids for the API's requests: bounded first, then tokenized on one worker thread."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chars_per_token = longest_token_chars(tokenizer)
        self.max_chars = max_model_len * self.chars_per_token
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harpoon-tokenize")

    async def _run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, lambda: fn(*args, **kwargs))

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_chars:
            raise APIError(400, f"{param} is too long: {num_chars} characters cannot fit this model's maximum context "
                                f"length of {self.max_model_len} tokens (no token spells more than "
                                f"{self.chars_per_token} characters)", param=param)

    def check_token_ids(self, token_ids: list[int], param: str) -> list[int]:
        if len(token_ids) >= self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the {param} "
                                f"has {len(token_ids)}, leaving no room for output", param=param)
        return token_ids

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, whatever their number (the context bounds them only as a prompt)."""
        self.check_chars(len(text), param)
        return await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_prompt(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, refused (400) if they cannot fit the context. A long text is first tokenized in
        part: a prefix holding far more tokens than the context is enough to refuse it (the whole has at least
        those, but for the last word the cut may split), at a fraction of the whole's cost."""
        self.check_chars(len(text), param)
        probe = PROBE_CHARS_PER_TOKEN * self.max_model_len
        if len(text) > probe:
            head = await self._run(self.tokenizer.encode, text[:probe], add_special_tokens=add_special_tokens)
            if len(head) >= self.max_model_len + PROBE_MARGIN_TOKENS:
                raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the "
                                    f"{param} has more than {len(head) - PROBE_MARGIN_TOKENS} in its first {probe} "
                                    "characters alone", param=param)
        ids = await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return self.check_token_ids(ids, param)

    async def completion_prompts(self, body: CompletionRequest) -> list[Prompt]:
        items = as_prompt_list(body.prompt)
        if not items or any(not item for item in items):
            raise APIError(400, "prompt must not be empty", param="prompt")
        for item in items:  # every bound before any tokenizing
            if isinstance(item, str):
                self.check_chars(len(item), "prompt")
            else:
                self.check_token_ids(item, "prompt")
        return [Prompt(item, await self.encode_prompt(item)) if isinstance(item, str) else Prompt(None, list(item))
                for item in items]

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, template_kwargs: dict[str, object] | None = None,
                          tools: list[dict] | None = None) -> Prompt:
        """``render_chat`` on the worker, its messages' text bounded first and its rendered text before tokenizing."""
        self.check_chars(sum(m.num_chars() for m in messages), "messages")
        return await self._run(render_chat, self.tokenizer, messages, add_generation_prompt, continue_final_message,
                               template_kwargs, tools, self.check_chars)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, object] | None = None,
                tools: list[dict] | None = None, check_chars: CheckChars | None = None) -> Prompt:
    """The conversation through the model's chat template. ``template_kwargs`` reach the template as variables
    (e.g. Qwen3's ``enable_thinking``); none may stand for one of apply_chat_template's own arguments.
    ``check_chars(num_chars, param)`` bounds the rendered text before it is tokenized."""
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "continue_final_message continues the last message: it needs add_generation_prompt "
                            "false", param="continue_final_message")
    reserved = sorted(set(template_kwargs or ()) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    conversation = [m.for_template() for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools or None,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # a template may refuse a conversation (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if check_chars is not None:
        check_chars(len(text), "messages")
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))
