"""Typed messages between the server and the engine core's loop (pickled across the process boundary).

Light on purpose: the API process imports this module, and with it neither the model nor the kernels."""

from __future__ import annotations

from dataclasses import dataclass

from engine.limits import EngineLimits
from engine.outputs import EngineCoreOutput, EngineStats
from engine.pooling import PoolingSpec
from engine.sampling_params import SamplingParams


# ---- server -> engine -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None = None  # time.monotonic() when the server received it, for its timeline


@dataclass(frozen=True)
class DebugQuery:
    """A question about the engine's state, answered between two steps by a ``DebugAnswer``: ``"requests"`` (the
    timelines of ``request_id``), ``"recent"`` (summaries of the latest requests), ``"kv"`` (the KV pool's view) or
    ``"memory"`` (the memory ledger, measured now)."""

    query_id: int
    what: str
    request_id: str | None = None


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- engine -> server -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    model_path: str
    device: str
    dtype: str
    limits: EngineLimits
    kv_cache: str  # the capacity line logged at start-up
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: tuple[int, ...] = ()  # the tokens that end a generation (a grammar allows them once complete)
    backend: str = ""  # which backend runs the steps, and how (TorchBackend.describe)
    gemm_plan: dict | None = None  # a CPU backend's measured GEMM plan (engine/backends/gemm_plan.py), its ISA
    kernel_plan: tuple[dict, ...] = ()  # every choice start-up made, with what it measured (engine/kernel_plan.py)
    kernel_plan_labels: str = ""  # the same, name=chosen;... (the /metrics info series' label)
    request_timelines: int = 0  # finished requests whose timelines the engine keeps (engine/timeline.py)
    pooling: PoolingSpec | None = None  # an embedding model's pooling (engine/pooling.py); None: it generates


@dataclass(frozen=True)
class EngineReady:
    info: EngineInfo


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[EngineCoreOutput]
    stats: EngineStats


@dataclass(frozen=True)
class DebugAnswer:
    query_id: int
    payload: object  # JSON-ready; None where the engine keeps no such record


@dataclass(frozen=True)
class RequestRejected:
    request_id: str
    message: str
    param: str | None = None  # the request field at fault, where known


@dataclass(frozen=True)
class EngineFailed:
    message: str
