"""N-gram speculative decoding without a model: drafting, acceptance, and the scheduler's bookkeeping of a verify
step (the test plays the model runner by handing back the tokens it emits)."""

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SpeculativeConfig
from engine.output_processor import OutputProcessor
from engine.outputs import EngineCoreOutput, ModelRunnerOutput, StepCounters
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import NgramProposer, accepted_tokens, can_draft, propose_ngram

EOS = 0


def test_propose_takes_the_latest_match_of_the_longest_ngram():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 3, 9, 1, 2, 8, 4, 7, 1, 2]
    # "1 2" occurs at 1 and 5 (and is the suffix): the latest earlier match is at 5, followed by 8 4 7 1 2
    assert propose_ngram(tokens, 3, 1, 4) == [8, 4, 7]
    # the longest n-gram with an earlier match wins: "7 1 2" (at 0, followed by 6 1) over the later "1 2" (5 7)
    assert propose_ngram([7, 1, 2, 6, 1, 2, 5, 7, 1, 2], 2, 1, 3) == [6, 1]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []  # no token repeats
    assert propose_ngram([4, 6, 4], 2, 2, 3) == []  # min_n 2: the single-token match is not enough
    assert propose_ngram([4], 2, 1, 3) == []


def test_a_match_running_into_the_end_repeats_with_its_period():
    assert propose_ngram([9, 3, 3, 3], 5, 1, 2) == [3, 3, 3, 3, 3]
    assert propose_ngram([9, 1, 2, 1, 2], 5, 1, 4) == [1, 2, 1, 2, 1]


def test_accepted_tokens_stop_at_the_first_disagreement():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, plus the row after the last
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the model's own token replaces the first miss
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 7]) == [8]
    with pytest.raises(AssertionError):
        accepted_tokens([4], [4])


def make(request_id: str, prompt: list[int], max_tokens: int = 16, **params) -> Request:
    sp = SamplingParams(temperature=params.pop("temperature", 0), max_tokens=max_tokens, **params)
    return Request(request_id, prompt, sp, frozenset({EOS}), max_tokens)


def test_only_plain_greedy_requests_draft():
    assert can_draft(make("g", [1]))
    assert not can_draft(make("t", [1], temperature=0.7))
    assert not can_draft(make("p", [1], repetition_penalty=1.2))
    assert not can_draft(make("b", [1], logit_bias={3: 1.0}))
    assert not can_draft(make("l", [1], logprobs=2))
    pending = make("m", [1], min_tokens=2)
    assert not can_draft(pending)  # its rows would need EOS banned
    pending.append_output_token(3)
    pending.append_output_token(4)
    assert can_draft(pending)


def decoding(request_id: str, prompt: list[int], **kw) -> Request:
    """A request whose prompt is computed and whose first token is sampled: the next step decodes."""
    request = make(request_id, prompt, **kw)
    request.append_output_token(prompt[-1])
    request.num_computed_tokens = len(prompt)
    return request


def test_proposer_respects_batch_size_max_tokens_and_prefill():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=2))
    a = decoding("a", [5, 6, 5, 6, 5])  # tokens 5 6 5 6 5 5: "5" last seen at 4, followed by 5
    b = decoding("b", [7, 8, 7, 8, 7], max_tokens=3)  # 1 output so far: at most 3 - 1 - 1 = 1 draft
    mid_prompt = make("c", [1, 2, 1, 2, 1])
    proposer.propose([a, b])
    assert a.spec_token_ids == [5, 5, 5, 5] and b.spec_token_ids == [7]
    proposer.propose([a, b, mid_prompt])  # over disable_by_batch_size: nobody drafts
    assert a.spec_token_ids == b.spec_token_ids == mid_prompt.spec_token_ids == []
    proposer.propose([mid_prompt])
    assert mid_prompt.spec_token_ids == []


def step(sched: Scheduler, bm: BlockManager, emitted: dict[str, list[int]]):
    out = sched.schedule()
    bm.check_integrity()
    by_id = {r.request_id: r for r in out.scheduled_requests}
    outputs = sched.update_from_output(out, ModelRunnerOutput(emitted))
    finished = [by_id[o.request_id] for o in outputs if o.finished]
    bm.check_integrity()
    return out, finished


def test_verify_step_keeps_accepted_drafts_and_rolls_back_the_rest():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = make("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    sched.add_request(a)
    step(sched, bm, {"a": [7]})  # prefill: 6 tokens computed, 7 sampled
    a.spec_token_ids = [8, 9, 10, 11]
    out, _ = step(sched, bm, {"a": [8, 9, 12]})  # drafts 8 9 kept, 10 rejected (the model says 12)
    assert out.num_scheduled_tokens == {"a": 5} and out.spec_token_ids == {"a": [8, 9, 10, 11]}
    assert bm.get_block_ids("a") == [0, 1, 2]  # room for positions 6..10 was allocated
    assert a.output_token_ids == [7, 8, 9, 12]
    assert a.num_computed_tokens == 9 and a.num_tokens == 10  # K/V of 7 8 9 kept; 12 is the next query
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (4, 2)
    a.spec_token_ids = []
    out, _ = step(sched, bm, {"a": [13]})  # a plain decode again, over the rejected drafts' slots
    assert out.num_scheduled_tokens == {"a": 1} and out.spec_token_ids == {}
    assert a.num_computed_tokens == 10


def test_drafts_are_cut_to_the_token_budget():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=3)
    a = make("a", [1, 2], max_tokens=10)
    sched.add_request(a)
    step(sched, bm, {"a": [3]})
    a.spec_token_ids = [4, 5, 6, 7]
    out, _ = step(sched, bm, {"a": [4, 5, 9]})
    assert out.num_scheduled_tokens == {"a": 3} and out.spec_token_ids == {"a": [4, 5]}
    assert a.output_token_ids == [3, 4, 5, 9] and a.num_computed_tokens == 5


def test_a_stop_inside_accepted_drafts_drops_the_tokens_after_it():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = make("a", [1, 2, 3], max_tokens=10)
    sched.add_request(a)
    step(sched, bm, {"a": [4]})
    a.spec_token_ids = [5, EOS, 6]
    _, finished = step(sched, bm, {"a": [5, EOS, 6, 7]})
    assert finished == [a] and a.output_token_ids == [4, 5, EOS]
    assert bm.num_free_blocks == bm.num_blocks


def test_engine_outputs_carry_only_the_tokens_kept(monkeypatch):
    """EngineCore.step reports what the scheduler kept, not everything the runner emitted."""
    from engine.engine_core import EngineCore

    engine = EngineCore.__new__(EngineCore)
    bm = BlockManager(8, 4)
    engine.scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    engine._compiling = {}  # no grammar requests
    engine.counters, engine._token_flops, engine._logit_row_flops = StepCounters(), 0, 0
    engine.timelines = None
    a = make("a", [1, 2, 3], max_tokens=4)
    engine.scheduler.add_request(a)
    emitted = iter([[4], [5, 6, 7, 8]])

    class Runner:
        def execute(self, sched):
            return ModelRunnerOutput(sampled_token_ids={"a": next(emitted)})

    engine.model_runner = Runner()
    assert [o.new_token_ids for o in engine.step()] == [[4]]
    a.spec_token_ids = [5, 6, 7]
    (out,) = engine.step()
    assert out.new_token_ids == [5, 6, 7] and out.finish_reason == "length"  # max_tokens 4 cuts the bonus token


def test_a_stop_string_inside_a_multi_token_output_cuts_there(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(" red green blue yellow")
    processor = OutputProcessor(tok)
    processor.add_request("a", 0, tok.encode("Colors:"), SamplingParams(stop=[" green"]))
    state, stopped = processor.process(EngineCoreOutput("a", ids))
    assert stopped and state.text == " red" and state.stop_reason == " green"
    assert state.token_ids == ids[: len(tok.encode(" red green"))]  # the tokens after the stop are not reported


@pytest.mark.parametrize("bad, message", [
    ("{", "not valid JSON"),
    ('{"method": "eagle"}', "method must be 'ngram'"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "must not exceed"),
    ('{"disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"lookahead": 2}', "unknown key(s) lookahead"),
    ("[4]", "must be a JSON object"),
])
def test_bad_speculative_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(speculative_config=bad)


def test_speculative_config_from_json_dict_or_flag():
    from engine.arg_utils import parse_engine_args

    expected = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=None)
    assert EngineConfig(speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": None}
                        ).speculative_config == expected
    args = parse_engine_args(["--speculative-config", '{"num_speculative_tokens": 3, "disable_by_batch_size": null}'])
    assert EngineConfig(**args).speculative_config == expected
    assert EngineConfig().speculative_config is None
