"""The offline API on the default model: outputs, n > 1, seeds, logprobs, stops and errors."""

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import PROMPTS, quick


@pytest.fixture(scope="module")
def llm():
    return LLM(**quick())


def assert_pool_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_string_and_token_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    by_text = llm.generate(PROMPTS[0], params)[0]
    by_ids = llm.generate(by_text.prompt_token_ids, params)[0]
    assert by_text.prompt == PROMPTS[0] and by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)
    assert by_text.outputs[0].finish_reason == "length"
    assert_pool_free(llm)


def test_n_samples_with_seed_are_distinct_and_repeatable(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=123)
    first = llm.generate(PROMPTS[2], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    texts = [c.token_ids for c in first.outputs]
    assert len({tuple(t) for t in texts}) > 1
    # The same seed gives the same samples, alone or beside other (unseeded) prompts.
    crowd = llm.generate(
        [PROMPTS[5], PROMPTS[2], PROMPTS[6]],
        [SamplingParams(temperature=0.8, max_tokens=20), params, SamplingParams(max_tokens=5)],
    )
    assert [c.token_ids for c in crowd[1].outputs] == texts
    assert_pool_free(llm)


def _hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [len, vocab]: row p scores token p + 1


def test_logprobs_and_prompt_logprobs_match_transformers(llm, hf_smollm2):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate(PROMPTS[4], params)[0]
    completion = out.outputs[0]
    ref = _hf_logprobs(hf_smollm2, out.prompt_token_ids + completion.token_ids)
    num_prompt = len(out.prompt_token_ids)

    assert len(completion.logprobs) == len(completion.token_ids)
    for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[num_prompt - 1 + i]
        assert entry[token_id].rank == 1  # greedy
        assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        top3 = row.topk(3).indices.tolist()
        assert set(top3) <= set(entry)
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )

    assert len(out.prompt_logprobs) == num_prompt and out.prompt_logprobs[0] is None
    for p in range(1, num_prompt):
        token_id = out.prompt_token_ids[p]
        entry = out.prompt_logprobs[p]
        row = ref[p - 1]
        assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert entry[token_id].rank == int((row > row[token_id]).sum()) + 1
        assert set(row.topk(2).indices.tolist()) <= set(entry)
    assert_pool_free(llm)


def test_prompt_logprobs_survive_chunked_prefill(llm):
    chunked, whole = LLM(**quick(max_num_batched_tokens=7)), llm
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a = chunked.generate(PROMPTS[6], params)[0].prompt_logprobs
    b = whole.generate(PROMPTS[6], params)[0].prompt_logprobs
    assert len(a) == len(b)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].logprob == pytest.approx(y[k].logprob, abs=1e-4)


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate(PROMPTS[6], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    words = base.text.split()
    stop = words[3]
    out = llm.generate(PROMPTS[6], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    kept = llm.generate(PROMPTS[6], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)] and kept.token_ids == out.token_ids

    stop_id = base.token_ids[4]
    out = llm.generate(PROMPTS[6], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    # the stop token's own text is left out, as a stop string's is, unless include_stop_str_in_output
    decode = llm.tokenizer.decode
    assert completion.text == decode(completion.token_ids[:-1]) != decode(completion.token_ids)
    kept = llm.generate(PROMPTS[6], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == decode(completion.token_ids) and kept.token_ids == completion.token_ids
    assert_pool_free(llm)


def test_eos_finishes_with_stop_and_ignore_eos_runs_to_length(llm):
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_dict=False
    )
    out = llm.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    shown = llm.generate([chat], SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False))[0]
    assert shown.outputs[0].text == out.text  # special tokens shown, but not the EOS that ended the text
    forced = llm.generate([chat], SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 3, ignore_eos=True))
    assert forced[0].outputs[0].finish_reason == "length"
    assert len(forced[0].outputs[0].token_ids) == len(out.token_ids) + 3


def test_bad_requests_are_rejected_and_leave_the_pool_untouched(llm):
    too_long = list(range(10, 10 + llm.engine.max_model_len))
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([too_long], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**9]], SamplingParams())
    with pytest.raises(ValueError, match="not a token id"):
        llm.generate([[1, "a"]], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    assert_pool_free(llm)


def test_request_larger_than_the_pool_is_rejected_not_looped():
    small = LLM(kv_cache_memory=4 * 2 * 30 * 3 * 64 * 4 * 16, max_model_len=512)  # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match="pool holds only 64"):
        small.generate(PROMPTS[0], SamplingParams(max_tokens=100))
    out = small.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    assert len(out[0].outputs[0].token_ids) == 20


def test_max_tokens_none_runs_to_the_context_limit():
    short = LLM(**quick(max_model_len=40))
    ids = short.tokenizer.encode(PROMPTS[0])
    out = short.generate([ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(ids) + len(out.token_ids) == 40 and out.finish_reason == "length"


def test_a_step_that_samples_nothing(llm):
    """A lone prompt longer than the step budget: its first steps only write K/V and sample nothing."""
    chunked = LLM(**quick(max_num_batched_tokens=16))
    long_prompt = PROMPTS[7] * 2
    out = chunked.generate(long_prompt, SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.prompt_token_ids) > 3 * 16 and len(out.outputs[0].token_ids) == 4
    reference = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_grammar_that_fails_to_compile_raises_and_leaves_the_engine_serving(llm, monkeypatch):
    def failing(params: StructuredOutputsParams) -> object:
        raise ValueError("the regex was rejected: too many states")

    monkeypatch.setattr(llm.engine.grammars, "grammar", failing)
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    with pytest.raises(ValueError, match="too many states"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(temperature=0, max_tokens=50), params])
    assert not llm.engine.has_unfinished_requests()
    assert_pool_free(llm)
    monkeypatch.undo()
    [out] = llm.generate(PROMPTS[0], params)
    assert set(out.outputs[0].text) <= {"a", "b"}
