"""The asyncio face of the engine against a scripted engine client: how step outputs reach a request's consumer."""

from __future__ import annotations

import asyncio

import pytest

from engine.engine_core import EngineStats
from engine.limits import EngineLimits
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, Choice, RequestRejectedError
from server.engine_client import EngineClient
from server.messages import AbortRequests, AddRequest, EngineInfo, StepOutputs
from server.metrics import Metrics

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
