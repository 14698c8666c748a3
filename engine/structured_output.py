"""Structured outputs: a grammar (a JSON schema, any JSON object, a regex, a choice of strings, EBNF) that keeps a
request's output inside it, token by token, through xgrammar.

Why this shape: the model proposes logits, the grammar says which tokens may come next. Each step every sampled
request with a grammar fills a bitmask of its allowed tokens (a few microseconds a row on SmolLM2's 49k tokens),
the sampler sends the other tokens' logits to -inf before anything else touches them, and the scheduler feeds each
new token back to the request's matcher. Greedy stays exact: the argmax of the masked logits. When the grammar is
complete only the end-of-sequence tokens are allowed, and accepting one ends the request.

Compiling a grammar for a vocabulary can take seconds (a JSON schema's ``maxLength: 100`` takes ~1.2 s for SmolLM2's
49k tokens), so it is split in two: ``check_grammar`` parses the grammar (under a millisecond; every error a user can
make shows here) and ``GrammarCompiler.submit`` compiles its token masks on a worker thread, which xgrammar runs
without the GIL. The engine keeps stepping meanwhile and admits the request once its grammar is ready.

xgrammar is imported with the first grammar, so an engine that never sees one never pays for the import.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.sampling_params import StructuredOutputsParams
from kernels import cdiv

# NOTE: the compile thread runs at this much lower priority than the steps. On two cores a compile at the same
# priority tripled the steps it overlapped (16 streams: 33 -> 102 ms a step); at +10 they took 15-25% longer and
# the compile 1.5-2x as long (loadtest/grammar_compile.py). SCHED_IDLE spared the steps wholly but starved the
# compile for as long as the load lasted (10 s at 64 streams).
COMPILE_NICENESS = 10
RECENT_GRAMMARS = 32  # compiled grammars kept for an answer without the compile thread (xgrammar keeps more)
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
    return torch.full((num_rows, cdiv(vocab_size, 32)), -1, dtype=torch.int32)  # [rows, words]: all allowed


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear: the C kernel where it can (~100x faster on a
    CPU than unpacking every bit in torch), else torch."""
    from kernels import cpu as cpu_kernels  # here, not at import: the API process parses grammars without kernels

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

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.load_tokenizer = load_tokenizer  # called when the first grammar needs the tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None
        self._executor: ThreadPoolExecutor | None = None
        # The grammars compiled last, so that a request whose schema was seen lately gets its matcher at once
        # instead of waiting its turn on the compile thread (which runs at a lower priority than the steps).
        self._recent: OrderedDict[StructuredOutputsParams, object] = OrderedDict()
        self._recent_lock = threading.Lock()

    def _xgrammar_compiler(self) -> object:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.load_tokenizer(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            # NOTE: one thread: the steps use the cores too. The cache is bounded: a server that sees a new schema in
            # every request must not grow without end.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar, or ValueError with a message for the user."""
        compiler = self._xgrammar_compiler()
        any_whitespace = not params.disable_any_whitespace
        with _user_errors(params.kind):
            if params.kind == "json":
                compiled = compiler.compile_json_schema(params.json, any_whitespace=any_whitespace)
            elif params.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            elif params.kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            else:
                compiled = compiler.compile_grammar(_ebnf(params))
        with self._recent_lock:
            self._recent[params] = compiled
            self._recent.move_to_end(params)
            while len(self._recent) > RECENT_GRAMMARS:
                self._recent.popitem(last=False)
        return compiled

    def recently_compiled(self, params: StructuredOutputsParams) -> object | None:
        with self._recent_lock:
            return self._recent.get(params)

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(self.compile(params)))

    def submit(self, params: StructuredOutputsParams) -> Future[Grammar]:
        """``grammar(params)`` on the compile thread, one grammar at a time in the order submitted; a grammar
        compiled lately is answered at once, its future already done."""
        compiled = self.recently_compiled(params)
        if compiled is not None:
            import xgrammar as xgr

            done: Future[Grammar] = Future()
            done.set_result(Grammar(xgr.GrammarMatcher(compiled)))
            return done
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile",
                                                initializer=_lower_priority)
        return self._executor.submit(self.grammar, params)


def check_grammar(params: StructuredOutputsParams) -> None:
    """Parse the grammar without compiling its token masks (no tokenizer needed): ValueError with a message for the
    user if it is not one xgrammar accepts."""
    import xgrammar as xgr

    with _user_errors(params.kind):
        if params.kind == "json":
            json.loads(params.json)
            xgr.Grammar.from_json_schema(params.json, any_whitespace=not params.disable_any_whitespace)
        elif params.kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif params.kind in ("choice", "grammar"):
            xgr.Grammar.from_ebnf(_ebnf(params))


def _lower_priority() -> None:
    """Linux gives each thread its own nice value: this lowers the calling thread's alone."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)


def _ebnf(params: StructuredOutputsParams) -> str:
    if params.kind == "choice":  # EBNF string literals take JSON's escapes; non-ASCII stays as it is
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
    return params.grammar


@contextlib.contextmanager
def _user_errors(kind: str) -> Iterator[None]:
    """xgrammar's errors about a grammar as ValueErrors that name what was rejected."""
    try:
        yield
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except RuntimeError as e:
        raise ValueError(f"the {_WHAT[kind]} was rejected: {_xgrammar_message(e)}") from None


def _xgrammar_message(error: RuntimeError) -> str:
    """xgrammar's message without its timestamp, source location and failed check."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    return re.sub(r"^Check failed: .*? is false:\s*", "", text)
