"""The asyncio face of the engine against a scripted engine client: how step outputs reach a request's consumer."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from engine.limits import EngineLimits
from engine.messages import AbortRequests, AddRequest, EngineFailed, EngineInfo, StepOutputs
from engine.outputs import EngineCoreOutput, EngineStats, Logprob
from engine.sampling_params import SamplingParams
from server import async_engine
from server.async_engine import AsyncEngine, Choice, EngineDeadError, RequestRejectedError
from server.engine_client import EngineClient
from server.metrics import Metrics
from server.protocol import APIError

LIMITS = EngineLimits(max_model_len=64, vocab_size=100, block_size=16, num_blocks=8)
STATS = EngineStats(0, 0, 0.0, 8, 8, 0)


class ScriptedClient(EngineClient):
    """Answers each AddRequest with the outputs ``script`` gives for it, as the engine's next step would."""

    def __init__(self, script: dict[str, list[EngineCoreOutput]]) -> None:
        super().__init__(config=None)
        self.info = EngineInfo("m", "/m", "cpu", "float32", LIMITS, "", 4, 64)
        self.script = script
        self.sent: list[object] = []

    async def start(self) -> EngineInfo:
        return self.info

    def send(self, message: object) -> None:
        self.sent.append(message)
        if isinstance(message, AddRequest):
            outputs = self.script[message.request_id]
            asyncio.get_running_loop().call_soon(self.handler, StepOutputs(outputs, STATS))

    def is_alive(self) -> bool:
        return True

    async def shutdown(self) -> None:
        pass


def test_an_output_with_an_error_fails_its_request_and_aborts_its_siblings(smollm2_tokenizer):
    """A grammar whose compile failed in the engine: the request's consumer gets the error, as it would a rejection
    at admission, and the other choice of the same HTTP request is aborted."""
    error = "the JSON schema was rejected: out of memory"
    client = ScriptedClient({"r-0": [EngineCoreOutput("r-0", [], finish_reason="abort", error=error)],
                             "r-1": [EngineCoreOutput("r-1", [5])]})
    engine = AsyncEngine(client, smollm2_tokenizer, Metrics("m"))
    choices = [Choice(f"r-{i}", [1, 2, 3], SamplingParams(max_tokens=4), i) for i in range(2)]

    async def consume() -> None:
        async for _ in engine.generate(choices):
            pass

    with pytest.raises(RequestRejectedError, match="out of memory"):
        asyncio.run(consume())
    abort = client.sent[-1]
    assert isinstance(abort, AbortRequests) and "r-1" in abort.request_ids  # (r-0's id is one the engine ignores)
    assert engine.num_in_flight == 0


class SteppingClient(ScriptedClient):
    """Sends each scripted output as a step of its own, every one before the consumer runs: a reader (a stream to a
    slow client) that has fallen behind the engine by all of them."""

    def send(self, message: object) -> None:
        self.sent.append(message)
        if isinstance(message, AddRequest):
            for output in self.script[message.request_id]:
                asyncio.get_running_loop().call_soon(self.handler, StepOutputs([output], STATS))


def test_a_stream_that_falls_behind_still_sends_a_chunk_per_output(smollm2_tokenizer):
    """The choice's state has taken every token before the stream reads the first output: the stream still sends
    one chunk per token, each with its own token's logprobs, the text held back for the stop string included, and
    nothing after the stop string (the engine's next output for it is dropped, the request aborted)."""
    from server.formats import CompletionFormat, TokenText
    from server.prompts import Prompt
    from server.serving import OpenAIServing

    ids = smollm2_tokenizer.encode(" 4, 5, 6, 7")
    entries = [{t: Logprob(-0.5 - k, 1)} for k, t in enumerate(ids)]
    outputs = [EngineCoreOutput("r-0", [t], [e]) for t, e in zip(ids, entries, strict=True)]
    client = SteppingClient({"r-0": outputs})
    engine = AsyncEngine(client, smollm2_tokenizer, Metrics("m"))
    serving = OpenAIServing(engine, smollm2_tokenizer, "m", max_waiting_requests=4)
    params = SamplingParams(max_tokens=len(ids), stop=[", 6"], logprobs=0)
    choice = Choice("r-0", [1, 2, 3], params, 0)

    async def stream() -> list[dict]:
        events = [e async for e in serving._stream({"id": "x"}, [choice], [Prompt(None, [1, 2, 3])],
                                                   CompletionFormat(TokenText(smollm2_tokenizer)), 0, False, False,
                                                   3, None, 0.0)]
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]

    chunks = [c["choices"][0] for c in asyncio.run(stream())]
    kept = next(ids[:k] for k in range(1, len(ids)) if ", 6" in smollm2_tokenizer.decode(ids[:k]))
    assert len(kept) < len(ids) - 1  # outputs come after the stop string's
    assert len(chunks) == len(kept)
    assert [c["logprobs"]["token_logprobs"] for c in chunks] == [[-0.5 - k] for k in range(len(kept))]
    assert "".join(c["text"] for c in chunks) == " 4, 5"
    assert [c["finish_reason"] for c in chunks] == [None] * (len(kept) - 1) + ["stop"]
    assert isinstance(client.sent[-1], AbortRequests) and engine.num_in_flight == 0


class DyingClient(ScriptedClient):
    """An engine that dies on demand and whose next starts fail ``failures`` times; it hangs (no outputs) until
    then, as a stalled engine does."""

    def __init__(self, failures: int = 0) -> None:
        super().__init__({})
        self.failures = failures
        self.starts = 0
        self.killed = 0

    async def start(self) -> EngineInfo:
        self.starts += 1
        if self.failures:
            self.failures -= 1
            raise RuntimeError("engine failed to start: no memory\ntraceback...")
        return self.info

    def send(self, message: object) -> None:
        self.sent.append(message)

    def die(self, reason: str = "engine process was killed by SIGKILL") -> None:
        self.handler(EngineFailed(reason))

    def kill(self) -> bool:
        self.killed += 1
        asyncio.get_running_loop().call_soon(self.die, "engine process was killed by SIGKILL")
        return True


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(async_engine, "FIRST_BACKOFF_S", 0.01)
    monkeypatch.setattr(async_engine, "WATCHDOG_INTERVAL_S", 0.01)


def test_a_dead_engine_fails_its_requests_and_is_replaced_with_back_off(smollm2_tokenizer, fast_backoff, monkeypatch):
    monkeypatch.setattr(async_engine, "STABLE_AFTER_S", 3600.0)  # every death is "soon after the last restart"
    client = DyingClient()
    engine = AsyncEngine(client, smollm2_tokenizer, Metrics("m"))
    delays = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        await real_sleep(0)

    async def scenario() -> None:
        monkeypatch.setattr(async_engine.asyncio, "sleep", sleep)
        choice = Choice("r-0", [1, 2, 3], SamplingParams(max_tokens=4), 0)

        async def consume() -> None:
            async for _ in engine.generate([choice]):
                pass

        task = asyncio.ensure_future(consume())
        await real_sleep(0)
        client.die()
        with pytest.raises(EngineDeadError, match="killed by SIGKILL; the request was lost"):
            await task
        with pytest.raises(APIError) as refused:  # while the new engine starts
            engine.check_serving()
        assert refused.value.status == 503 and refused.value.headers["Retry-After"]
        assert engine.health_problem().endswith("a new engine is starting, retry shortly")
        for _ in range(3):
            await real_sleep(0.01)
            assert engine.dead_reason is None and engine.num_in_flight == 0
            client.die()
        await real_sleep(0.01)
        await engine.close()

    asyncio.run(scenario())
    assert delays == [0.0, 0.01, 0.02, 0.04]  # at once, then doubling while deaths follow restarts closely
    assert client.starts == 4 and engine.metrics.num_restarts == 4
    assert engine.metrics.engine_deaths._value.get() == 4


def test_an_engine_that_cannot_be_started_again_is_fatal(smollm2_tokenizer, fast_backoff):
    client = DyingClient(failures=async_engine.MAX_START_ATTEMPTS)
    fatal = []
    engine = AsyncEngine(client, smollm2_tokenizer, Metrics("m"), on_fatal=fatal.append)

    async def scenario() -> None:
        client.die()
        await asyncio.sleep(0.5)

    asyncio.run(scenario())
    assert client.starts == async_engine.MAX_START_ATTEMPTS
    assert fatal == [engine.fatal_reason] and "no memory" in fatal[0] and "5 attempts" in fatal[0]
    assert engine.health_problem() == engine.fatal_reason


def test_an_engine_that_stalls_with_work_in_flight_is_killed_and_replaced(smollm2_tokenizer, fast_backoff):
    client = DyingClient()
    engine = AsyncEngine(client, smollm2_tokenizer, Metrics("m"), stall_timeout=0.05)

    async def scenario() -> None:
        engine.start_watchdog()
        await asyncio.sleep(0.1)
        assert client.killed == 0  # idle is not stalled
        with pytest.raises(EngineDeadError, match="no progress"):
            async for _ in engine.generate([Choice("r-0", [1, 2, 3], SamplingParams(max_tokens=4), 0)]):
                pass
        await asyncio.sleep(0.05)
        assert engine.dead_reason is None
        await engine.close()

    asyncio.run(scenario())
    assert client.killed == 1 and client.starts == 1


@pytest.mark.parametrize("output", [
    EngineCoreOutput("r", [7]),
    EngineCoreOutput("r", [1, 2], new_logprobs=[{1: Logprob(-0.5, 1)}, {2: Logprob(-1.0, 2)}], prompt_logprobs=[None],
                     finish_reason="stop", stop_reason="x", num_prompt_tokens=3, queue_time=0.25,
                     num_cached_tokens=16),
    EngineCoreOutput("r", [], finish_reason="abort", error="the prompt is too long"),
])
def test_a_core_output_crosses_the_pipe_whole(output):
    """Outputs reach the API process pickled as their fields in order (EngineCoreOutput.__reduce__): every field
    arrives, whichever are set."""
    assert pickle.loads(pickle.dumps(StepOutputs([output], STATS))).outputs == [output]
