"""Per-request timelines (engine/timeline.py), the KV pool's view (BlockManager.view) and the debug routes that
serve them (server/debug.py)."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.timeline import Timelines
from tests.server_process import ServerProcess


def run(engine: EngineCore, prompts: dict[str, list[int]], max_tokens: int, abort_at: dict[str, int] | None = None
        ) -> None:
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    step = 0
    while engine.has_unfinished_requests():
        for request_id, when in (abort_at or {}).items():
            if when == step:
                engine.abort_requests([request_id])
        engine.step()
        engine.block_manager.check_integrity()
        step += 1


def tiny_engine(tiny_model, **options) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model("llama-gqa-tied")), attention_backend="cpu", block_size=4,
                                   **options))


def test_a_timeline_tells_queueing_chunks_decodes_first_token_and_finish(tiny_model):
    engine = tiny_engine(tiny_model, kv_cache_memory=4 << 20, max_num_batched_tokens=8, request_timelines=10)
    prompts = {"a": list(range(3, 23)), "b": list(range(40, 45)), "c": list(range(60, 90))}
    run(engine, prompts, max_tokens=6, abort_at={"c": 5})
    for request_id in ("a", "b"):
        [t] = engine.timelines.get(request_id)
        kinds = [e["event"] for e in t["events"]]
        assert kinds[0] == "queued" and kinds[1] == "scheduled" and kinds[-1] == "finished"
        assert kinds.index("first_token") > kinds.index("prefill")
        chunks = [e for e in t["events"] if e["event"] == "prefill"]
        assert sum(e["tokens"] for e in chunks) == len(prompts[request_id])  # nothing cached in a fresh pool
        assert all(e["step_tokens"] <= 8 and 1 <= e["batch"] <= 3 for e in chunks)
        decodes = [e for e in t["events"] if e["event"] == "decode"]
        assert sum(e["steps"] for e in decodes) == sum(e["tokens"] for e in decodes) == 5  # the first came from prefill
        assert all(e["batch_min"] <= e["batch_max"] for e in decodes)
        times = [e["t"] for e in t["events"]]
        assert times == sorted(times)
        assert t["finish_reason"] == "length" and t["num_output_tokens"] == 6
        assert 0 < t["ttft_s"] <= t["e2e_s"]
    assert len(chunks) > 1  # "a" and "c" are cut into chunks of the 8-token budget
    [c] = engine.timelines.get("c")
    assert c["finish_reason"] == "abort" and c["events"][-1]["event"] == "finished"
    assert engine.timelines.get("nope") == []


def test_timelines_keep_the_last_n_requests_and_bounded_events():
    timelines = Timelines(capacity=2, max_events=4)
    from engine.outputs import EngineCoreOutput

    for i in range(5):
        timelines.arrived(f"r{i}", 3)
        timelines.produced([EngineCoreOutput(f"r{i}", [7], finish_reason="stop")])
    assert [list(timelines.get(f"r{i}")) != [] for i in range(5)] == [False, False, False, True, True]
    assert not timelines.live
    timelines.arrived("long", 3)
    for _ in range(10):
        timelines.aborted("other")  # unknown: ignored
        timelines.live["long"].add({"t": 0.0, "event": "x"}, timelines.max_events)
    timelines.aborted("long")
    [t] = timelines.get("long")
    assert len(t["events"]) == 5 and t["events"][-1]["event"] == "finished" and t["dropped_events"] == 7
    with pytest.raises(ValueError):
        Timelines(capacity=0)


def test_a_preempted_request_shows_its_preemption_and_resume(tiny_model):
    # 12 blocks of 4 tokens: three 14-token prompts decoding 12 tokens cannot all stay
    engine = tiny_engine(tiny_model, kv_cache_memory=12 * 2 * 2 * 2 * 16 * 4 * 4, request_timelines=10)
    assert engine.block_manager.num_blocks == 12
    run(engine, {f"p{i}": [5 + i] * 14 for i in range(3)}, max_tokens=12)
    assert engine.scheduler.num_preemptions > 0
    preempted = [t for i in range(3) for t in engine.timelines.get(f"p{i}") if t["num_preemptions"]]
    assert preempted
    for t in preempted:
        kinds = [e["event"] for e in t["events"]]
        assert "preempted" in kinds and kinds[kinds.index("preempted") + 1] == "resumed"
        assert t["finish_reason"] == "length" and t["num_output_tokens"] == 12


def test_recent_lists_live_requests_first_with_their_state(tiny_model):
    engine = tiny_engine(tiny_model, kv_cache_memory=4 << 20, max_num_seqs=1, request_timelines=10)
    for request_id in ("a", "b"):
        engine.add_request(request_id, list(range(3, 13)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [(r["request_id"], r["state"]) for r in engine.timelines.recent(10)] == [("b", "queued"), ("a", "queued")]
    engine.step()
    assert {r["request_id"]: r["state"] for r in engine.timelines.recent(10)} == {"a": "running", "b": "queued"}
    while engine.has_unfinished_requests():
        engine.step()
    [row] = engine.timelines.recent(1)
    assert row["request_id"] == "b" and row["state"] == "finished" and row["num_output_tokens"] == 3
    assert "events" not in row


def test_the_kv_view_counts_every_block_once_and_shows_shared_prefixes(tiny_model):
    engine = tiny_engine(tiny_model, kv_cache_memory=4 << 20)
    shared = list(range(3, 19))  # four full blocks
    for i in range(3):
        engine.add_request(f"s{i}", shared + [100 + i], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()  # the first request's full blocks are cached; the others take them
    view = engine.kv_view()
    bm = engine.block_manager
    assert view["free_blocks"] + view["used_blocks"] == view["num_blocks"] == bm.num_blocks
    states = view["block_states"]
    assert len(states) == bm.num_blocks and states.count(".") + states.count("c") == view["free_blocks"]
    assert states.count("c") == view["cached_evictable_blocks"]
    assert states.count("u") + states.count("s") == view["used_blocks"]
    rows = {r["request_id"]: r for r in view["requests"]}
    assert set(rows) == set(bm.block_tables)
    assert any(r["shared_blocks"] >= 4 for r in rows.values()) and view["prefix_cache_hit_rate"] > 0
    for r in rows.values():
        assert r["blocks"] == len(bm.block_tables[r["request_id"]])
        assert 0 <= r["empty_slots"] == r["blocks"] * 4 - r["tokens"] < 2 * 4
        assert all(view["block_owners"][b] >= 0 for b in bm.block_tables[r["request_id"]])
    assert view["empty_slots"] == sum(r["empty_slots"] for r in rows.values())


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--enable-debug-routes", "--request-timelines", "5", "--api-key", "k")
    yield s
    s.stop_checking_the_engine_never_died()


def test_debug_routes_serve_a_requests_timeline_and_the_pool(server):
    auth = {"Authorization": "Bearer k"}
    assert httpx.get(f"{server.base_url}/debug/kv").status_code == 401
    r = httpx.post(f"{server.base_url}/v1/completions", headers=auth, timeout=60,
                   json={"prompt": "The capital of France is", "max_tokens": 5, "n": 2, "temperature": 0})
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
    timeline = httpx.get(f"{server.base_url}/debug/requests/{r.json()['id']}", headers=auth).json()
    assert [s["request_id"] for s in timeline["samples"]] == [f"{r.json()['id']}-0", f"{r.json()['id']}-1"]
    for sample in timeline["samples"]:
        kinds = [e["event"] for e in sample["events"]]
        assert kinds[:3] == ["arrival", "queued", "scheduled"] and kinds[-1] == "finished"
        assert sample["num_output_tokens"] == 5 and sample["finish_reason"] == "length"
        assert sample["events"][0]["t"] <= sample["events"][1]["t"]  # the server's arrival, before the engine's
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", headers=auth, timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}) as s:
        stream_id = s.headers["x-request-id"]
        assert stream_id in "".join(s.iter_text())
    assert httpx.get(f"{server.base_url}/debug/requests/{stream_id}", headers=auth).status_code == 200
    missing = httpx.get(f"{server.base_url}/debug/requests/cmpl-nope", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
    kv = httpx.get(f"{server.base_url}/debug/kv", headers=auth).json()
    assert kv["free_blocks"] + kv["used_blocks"] == kv["num_blocks"] and kv["requests"] == []
    assert kv["cached_blocks"] > 0 and len(kv["block_states"]) == kv["num_blocks"]
    for i in range(6):  # only the last 5 requests are kept
        httpx.post(f"{server.base_url}/v1/completions", headers=auth, timeout=60,
                   json={"prompt": f"{i}", "max_tokens": 1})
    assert httpx.get(f"{server.base_url}/debug/requests/{stream_id}", headers=auth).status_code == 404


def test_debug_memory_sets_the_engines_parts_against_its_rss(server):
    auth = {"Authorization": "Bearer k"}
    assert httpx.get(f"{server.base_url}/debug/memory").status_code == 401
    answer = httpx.get(f"{server.base_url}/debug/memory", headers=auth).json()
    engine, api = answer["engine"], answer["api_process"]
    assert set(engine["parts"]) == {"runtime", "weights", "kv_pool", "workspace"}
    assert sum(engine["parts"].values()) + engine["remainder"] == engine["measured"]["bytes"] == engine["host_rss"]
    assert engine["parts"]["kv_pool"] > 0 and engine["parts"]["weights"] > 0
    assert abs(engine["remainder"]) < engine["measured"]["bytes"] / 4  # the parts explain most of it
    assert api["pid"] == server.proc.pid and api["rss"] > 0


def test_held_tensor_bytes_counts_each_storage_once_and_follows_packed_copies():
    from dataclasses import dataclass
    from functools import partial

    from engine.memory_ledger import held_tensor_bytes

    @dataclass
    class Packed:
        panels: torch.Tensor

    base = torch.zeros(100, dtype=torch.float32)  # 400 bytes
    module = torch.nn.Linear(4, 2, bias=False)  # 32 bytes
    module.view = base[10:20]  # a view: the same storage as base
    module.kernel = partial(print, Packed(torch.zeros(8, dtype=torch.bfloat16)))  # 16 bytes
    cpu = torch.device("cpu")
    assert held_tensor_bytes([module, base, [base, {"again": base}]], cpu) == 400 + 32 + 16
    assert held_tensor_bytes([module, base], cpu, exclude=[base]) == 32 + 16


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_memory_ledger_adds_up_and_its_kv_formula_is_the_pool(tiny_model, backend):
    engine = EngineCore(EngineConfig(model=str(tiny_model("llama-gqa-tied")), attention_backend=backend,
                                     block_size=4, kv_cache_memory=4 << 20))
    ledger = engine.memory_ledger.refreshed()
    spec, pool = engine.kv_cache.spec, engine.kv_cache
    assert ledger.kv_pool == 2 * spec.num_layers * pool.num_tokens * spec.num_kv_heads * spec.head_dim * 4
    assert ledger.kv_formula == (f"2 x {spec.num_layers} layers x {pool.num_tokens} tokens x {spec.num_kv_heads} "
                                 f"kv_heads x {spec.head_dim} head_dim x 4 B")
    if backend == "torch":  # the plain modules: exactly their parameters and buffers, shared ones once
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*engine.model.parameters(), *engine.model.buffers()]}
        assert ledger.weights == sum(storages.values())
    else:  # packed panels replace the row-major weights, which are released
        assert 0 < ledger.weights
    assert sum(ledger.parts().values()) + ledger.remainder == ledger.measured == ledger.host_rss
    assert ledger.runtime > 0 and ledger.workspace >= 0
    text = "\n".join(ledger.lines())
    assert "kv_pool" in text and ledger.kv_formula in text and "process RSS" in text
