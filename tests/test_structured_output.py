"""Structured outputs: their parameters, the grammar mask, and the default model held to JSON schemas, regexes,
choices and EBNF. Greedy tokens under a grammar equal transformers' greedy generate under xgrammar's own logits
processor, beside plain requests, under preemption and with n-gram drafting on."""

import copy
import json
import re
import threading

import pytest
import torch
import xgrammar as xgr

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import GrammarCompiler, apply_bitmask, new_bitmask
from kernels import cpu as cpu_kernels
from tests.conftest import hf_greedy

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "country", "population"],
}
# Every value bounded, so even a high-temperature draw finishes inside max_tokens.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["answer", "count", "color"],
    "additionalProperties": False,
}
QUESTIONS = [
    "What is the capital of France? Answer in JSON.",
    "Tell me about Tokyo in JSON.",
    "Give me a phone number.",
    "Is the sky blue?",
    "Write a sum of three numbers.",
]
BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2: layers x kv_heads x head_dim, fp32, 16-token blocks
MAX_NEW = 40


# ---- parameters and the mask (no model) ------------------------------------------------------------------------------
def test_params_name_exactly_one_grammar():
    with pytest.raises(ValueError, match="exactly one of .*got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="non-empty string"):
        StructuredOutputsParams(regex=" ")
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).json == '{"b": 1, "a": 2}'  # key order kept
    assert StructuredOutputsParams(choice=["x", "y"]).choice == ("x", "y")


def test_grammar_requests_are_never_plain_argmax_and_refuse_min_tokens():
    grammar = StructuredOutputsParams(json_object=True)
    assert SamplingParams(temperature=0).plain_argmax
    assert not SamplingParams(temperature=0, structured_outputs=grammar).plain_argmax  # no screened head, no drafts
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=grammar)


@pytest.mark.parametrize("path", ["c", "torch"])
def test_apply_bitmask_matches_xgrammar(path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    elif not cpu_kernels.available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 4), generator=gen, dtype=torch.int32)
    bitmask[1, 0] = 0  # a word with nothing allowed
    bitmask[0, 1] = -1  # one with everything
    logits = torch.randn(4, vocab, generator=gen)
    expected = logits.clone()
    full = new_bitmask(4, vocab)  # xgrammar's index i picks row i of both the logits and the bitmask
    full[[0, 2]] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, indices=[0, 2])
    apply_bitmask(logits, torch.tensor([0, 2]), bitmask)
    assert torch.equal(logits, expected) and bool(logits[2].isinf().any())
    if path == "c":
        with pytest.raises(ValueError, match="rows out of range"):
            cpu_kernels.apply_token_bitmask(logits, torch.tensor([4]), bitmask[:1])
        with pytest.raises(ValueError, match="do not fit"):
            cpu_kernels.apply_token_bitmask(logits, torch.tensor([0]), bitmask[:1, :3])
    assert new_bitmask(3, vocab).shape == (3, 4) and bool((new_bitmask(1, vocab) == -1).all())


# ---- the default model ----------------------------------------------------------------------------------------------
# float32 on each device, against transformers on the same device; on a GPU the mask takes the torch path.
DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


def engine_on(device: str, **options) -> EngineCore:
    options = {"quantized_matmul": "exact", **options}  # tokens are compared with transformers
    return EngineCore(EngineConfig(model=None, device=device, dtype="float32", max_num_batched_tokens=256, **options))


@pytest.fixture(scope="module")
def engine(device):
    return engine_on(device)


@pytest.fixture(scope="module")
def hf_model(device, hf_smollm2):
    return hf_smollm2 if device == "cpu" else copy.deepcopy(hf_smollm2).to(device)


@pytest.fixture(scope="module")
def chat_ids(smollm2_tokenizer) -> list[list[int]]:
    tok = smollm2_tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


GRAMMARS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"\(?[0-9]{3}\)?-[0-9]{3}-[0-9]{4}"),
    StructuredOutputsParams(choice=["yes", "no", "it depends"]),
    StructuredOutputsParams(grammar='root ::= num " + " num " + " num\nnum ::= [1-9] [0-9]?'),
]


def run(engine: EngineCore, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], str]]:
    """Serve the requests together to the end; (tokens, finish reason) of each. The pool ends empty."""
    for i, (ids, params) in enumerate(requests):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    finish: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        engine.block_manager.check_integrity()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [(tokens[str(i)], finish[str(i)]) for i in range(len(requests))]


def greedy(grammar: StructuredOutputsParams | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, structured_outputs=grammar)


@pytest.fixture(scope="module")
def expected(engine, hf_model, chat_ids) -> list[list[int]]:
    """transformers' greedy generate under xgrammar's logits processor (the same grammars, compiled for the same
    end-of-sequence tokens), and plain greedy for the plain requests."""
    compiler = GrammarCompiler(lambda: engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    refs = []
    for ids, grammar in zip(chat_ids, GRAMMARS, strict=True):
        with torch.inference_mode():
            prompt = torch.tensor([ids], device=hf_model.device)
            out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
                                    do_sample=False, pad_token_id=hf_model.generation_config.eos_token_id,
                                    logits_processor=[xgr.contrib.hf.LogitsProcessor(compiler.compile(grammar))])
        refs.append(out[0, len(ids) :].tolist())
    return refs + [hf_greedy(hf_model, ids, MAX_NEW) for ids in chat_ids[:2]]


def mixed_batch(chat_ids: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    return [(ids, greedy(g)) for ids, g in zip(chat_ids, GRAMMARS, strict=True)] + [
        (ids, greedy(None)) for ids in chat_ids[:2]
    ]


def test_greedy_under_a_grammar_equals_transformers_with_xgrammar(engine, chat_ids, expected):
    results = run(engine, mixed_batch(chat_ids))
    assert [tokens for tokens, _ in results] == expected
    texts = [engine.tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in results]
    assert [finish for _, finish in results[:5]] == ["stop"] * 5  # every grammar completed, then ended the output
    assert json.loads(texts[0]).keys() == SCHEMA["properties"].keys()
    assert isinstance(json.loads(texts[1]), dict)
    assert re.fullmatch(GRAMMARS[2].regex, texts[2]) and texts[3] in GRAMMARS[3].choice
    assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){2}", texts[4])


@pytest.mark.parametrize("pool_blocks", [None, 9])
def test_grammar_outputs_unchanged_by_preemption_and_drafting(device, chat_ids, expected, pool_blocks):
    """N-gram drafting on (grammar requests never draft: their tokens are not plain argmaxes) and, with a 9-block
    pool, preemption by recompute: each grammar keeps its place, as the request keeps its tokens."""
    memory = None if pool_blocks is None else pool_blocks * BYTES_PER_BLOCK
    engine = engine_on(device, kv_cache_memory=memory, speculative_config={"disable_by_batch_size": None})
    assert [tokens for tokens, _ in run(engine, mixed_batch(chat_ids))] == expected
    assert (engine.scheduler.num_preemptions > 0) == (pool_blocks is not None)
    assert engine.stats().spec_draft_tokens > 0


def test_sampled_outputs_stay_inside_their_grammars(engine, chat_ids):
    """At temperature 2 the model's own choices are close to random; only the mask keeps them in the grammar. (With
    any whitespace allowed, such draws can fill max_tokens with it: hence disable_any_whitespace.)"""
    grammars = [StructuredOutputsParams(json=BOUNDED_SCHEMA, disable_any_whitespace=True), *GRAMMARS[2:]]
    requests = [(chat_ids[i % len(chat_ids)], SamplingParams(temperature=2.0, seed=seed, max_tokens=150,
                                                             structured_outputs=g))
                for seed in range(3) for i, g in enumerate(grammars)]
    for (tokens, finish), (_, params) in zip(run(engine, requests), requests, strict=True):
        text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        grammar = params.structured_outputs
        assert finish == "stop", (grammar, text)
        if grammar.json is not None:
            assert text == json.dumps(json.loads(text))  # the separators json.dumps uses, no other whitespace
            value = json.loads(text)
            assert value.keys() == BOUNDED_SCHEMA["properties"].keys() and isinstance(value["answer"], bool)
            assert 0 <= value["count"] <= 999 and value["color"] in ("red", "green", "blue")
        elif grammar.regex is not None:
            assert re.fullmatch(grammar.regex, text), text
        elif grammar.choice is not None:
            assert text in grammar.choice
        else:
            assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){2}", text), text


def test_a_complete_grammar_ends_the_output_even_with_ignore_eos(engine, chat_ids):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, structured_outputs=GRAMMARS[3])
    [(tokens, finish)] = run(engine, [(chat_ids[3], params)])
    assert finish == "stop" and tokens[-1] in engine.eos_token_ids
    assert engine.tokenizer.decode(tokens, skip_special_tokens=True) in GRAMMARS[3].choice


@pytest.mark.parametrize(("grammar", "message"), [
    (StructuredOutputsParams(json='{"type": "objectx"}'), "JSON schema was rejected: Unsupported type"),
    (StructuredOutputsParams(json="{bad"), "not valid JSON"),
    (StructuredOutputsParams(regex="(a"), "regex was rejected: .*parenthesis"),
    (StructuredOutputsParams(grammar="root ::= foo"), "grammar was rejected: .*not defined"),
])
def test_bad_grammars_are_rejected_before_the_pool(engine, chat_ids, grammar, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", chat_ids[0], SamplingParams(structured_outputs=grammar))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def held_compiles(engine: EngineCore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every grammar compile on the engine's compile thread until the returned event is set (none is answered
    from the grammars compiled lately)."""
    gate = threading.Event()
    compile_grammar = engine.grammars.grammar

    def held(params: StructuredOutputsParams) -> object:
        assert gate.wait(timeout=60), "the test never released the compile"
        return compile_grammar(params)

    monkeypatch.setattr(engine.grammars, "grammar", held)
    monkeypatch.setattr(engine.grammars, "recently_compiled", lambda params: None)
    return gate


def test_a_grammar_compiled_lately_runs_from_the_first_step(engine, chat_ids, monkeypatch):
    """No wait on the compile thread for a schema seen lately: the request is scheduled by the step after it."""
    engine.grammars.compile(GRAMMARS[2])
    monkeypatch.setattr(engine.grammars, "grammar", lambda params: pytest.fail("went to the compile thread"))
    engine.add_request("seen", chat_ids[2], greedy(GRAMMARS[2]))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["seen"] and outputs[0].new_token_ids
    while engine.has_unfinished_requests():
        engine.step()


def test_requests_step_on_while_a_grammar_compiles(engine, chat_ids, expected, monkeypatch):
    """A compile runs beside the steps, not inside one: a plain request that arrived after the grammar request runs
    to its end while the compile is held, and the grammar request then runs as it would have."""
    gate = held_compiles(engine, monkeypatch)
    engine.add_request("grammar", chat_ids[0], greedy(GRAMMARS[0]))
    engine.add_request("plain", chat_ids[0], greedy(None))
    tokens: dict[str, list[int]] = {"grammar": [], "plain": []}
    finished: set[str] = set()
    while "plain" not in finished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    assert tokens == {"grammar": [], "plain": expected[5]}
    assert engine.has_unfinished_requests() and engine.stats().num_waiting == 1  # counted while it compiles
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["grammar"] == expected[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_aborted_while_its_grammar_compiles_never_runs(engine, chat_ids, monkeypatch):
    gate = held_compiles(engine, monkeypatch)
    engine.add_request("a", chat_ids[1], greedy(GRAMMARS[1]))  # compiling (held)
    engine.add_request("b", chat_ids[2], greedy(GRAMMARS[2]))  # queued behind it on the compile thread
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", chat_ids[1], greedy(None))
    engine.abort_requests(["a", "b"])
    assert not engine.has_unfinished_requests() and engine.stats().num_waiting == 0
    gate.set()
    assert engine.step() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_grammar_that_fails_to_compile_finishes_its_request_with_the_error(engine, chat_ids, monkeypatch):
    """The grammar parsed (add_request accepted it) but its compile failed: the request comes back from a step with
    the error, no tokens and finish reason abort, and the request beside it is untouched."""
    def failing(params: StructuredOutputsParams) -> object:
        raise ValueError("the JSON schema was rejected: out of memory")

    monkeypatch.setattr(engine.grammars, "grammar", failing)
    monkeypatch.setattr(engine.grammars, "recently_compiled", lambda params: None)
    engine.add_request("bad", chat_ids[0], greedy(GRAMMARS[0]))
    engine.add_request("plain", chat_ids[1], SamplingParams(temperature=0, max_tokens=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [bad] = [o for o in outputs if o.request_id == "bad"]
    assert (bad.error, bad.finish_reason, bad.new_token_ids) == ("the JSON schema was rejected: out of memory",
                                                                  "abort", [])
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "plain") == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
