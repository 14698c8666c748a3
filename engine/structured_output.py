"""Structured outputs: a grammar (a JSON schema, any JSON object, a regex, a choice of strings, EBNF) that keeps a
request's output inside it, token by token, through xgrammar.

Why this shape: the model proposes logits, the grammar says which tokens may come next. Each step every sampled
request with a grammar fills a bitmask of its allowed tokens (a few microseconds a row on SmolLM2's 49k tokens),
the sampler sends the other tokens' logits to -inf before anything else touches them, and the scheduler feeds each
new token back to the request's matcher. Greedy stays exact: the argmax of the masked logits. When the grammar is
complete only the end-of-sequence tokens are allowed, and accepting one ends the request.

xgrammar is imported with the first grammar, so an engine that never sees one never pays for the import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import torch

from engine.sampling_params import StructuredOutputsParams
from kernels import cpu as cpu_kernels

CACHE_LIMIT_BYTES = 256 << 20  # the most memory xgrammar's cache of compiled grammars may hold, per process
_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


class Grammar:
    """One request's place in its grammar. Invariant: every token the request emitted was accepted, in order (a
    preempted request keeps its tokens, so its grammar needs no rollback)."""

    def __init__(self, matcher: object) -> None:
        self._matcher = matcher  # xgrammar.GrammarMatcher
        self.rejected = False  # a token outside the grammar arrived (impossible through the mask; see Scheduler)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Bit t of row ``row`` (word t // 32, bit t % 32) set where token t may come next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if not self.rejected and not self._matcher.accept_token(token_id):
            self.rejected = True

    @property
    def terminated(self) -> bool:
        """Complete, with an end-of-sequence token accepted: nothing may follow."""
        return self._matcher.is_terminated()


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # [rows, words]: all allowed


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear: the C kernel where it can (~100x faster on a
    CPU than unpacking every bit in torch), else torch."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1 and cpu_kernels.available():
        cpu_kernels.apply_token_bitmask(logits, rows.cpu(), bitmask.cpu())
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool().to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary into per-request ``Grammar``s. xgrammar
    caches what it compiled, so a schema sent again costs only a new matcher."""

    def __init__(self, tokenizer: object, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None

    def _xgrammar_compiler(self) -> object:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            # NOTE: one thread: the engine compiles between steps on the cores the steps use. The cache is bounded:
            # a server that sees a new schema in every request must not grow without end.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar, or ValueError with a message for the user."""
        compiler = self._xgrammar_compiler()
        kind = params.kind
        try:
            any_whitespace = not params.disable_any_whitespace
            if kind == "json":
                json.loads(params.json)
                return compiler.compile_json_schema(params.json, any_whitespace=any_whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                # EBNF string literals take JSON's escapes; non-ASCII stays as it is
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(params.grammar)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        except RuntimeError as e:
            raise ValueError(f"the {_WHAT[kind]} was rejected: {_xgrammar_message(e)}") from None

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(self.compile(params)))


def _xgrammar_message(error: RuntimeError) -> str:
    """xgrammar's message without its timestamp, source location and failed check."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    return re.sub(r"^Check failed: .*? is false:\s*", "", text)
