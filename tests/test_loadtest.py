"""loadtest/: metric definitions on hand-made timelines, the stream client against a canned server, and a short real
run against a test server."""

import asyncio
import json
import subprocess

import pytest

import kernels.cpu as cpu_kernels
from loadtest.client import send, session
from loadtest.metrics import RequestRecord, parse_goodput, record_from_timeline, summarize
from loadtest.serve import engine_metrics, idle_engine_metrics
from loadtest.serve import main as bench_main
from tests.server_process import free_port


def test_record_from_timeline_matches_vllm_definitions():
    # Sent at t=10.0; chunks with a choice at 10.5, 10.6, 10.8, 11.1; 4 output tokens per usage.
    r = record_from_timeline(start=2.0, send=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1], prompt_tokens=5,
                             output_tokens=4)
    assert r.success and r.start == 2.0
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert record_from_timeline(0, 0, [], 1, 0).success is False
    assert RequestRecord(success=True, output_tokens=1, ttft=0.1, e2e=0.1).tpot is None


def test_summarize_percentiles_throughput_and_goodput():
    a = record_from_timeline(0, 0.0, [0.1, 0.2, 0.3], 10, 3)  # ttft 100 ms, tpot 100 ms
    b = record_from_timeline(0, 0.0, [0.3, 0.35, 0.4, 0.45, 0.5], 20, 5)  # ttft 300 ms, tpot 50 ms
    failed = RequestRecord(error="HTTP 500")
    s = summarize([a, b, failed], duration=2.0, goodput=parse_goodput(["ttft:200"]))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 8
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(75.0)
    assert s["itl_ms"]["median"] == pytest.approx(50.0)  # gaps: 100, 100, 50, 50, 50, 50
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(300 + (500 - 300) * 0.99)
    assert s["goodput"]["requests"] == 1 and s["goodput"]["request_goodput"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# What a canned server writes for each path, in separate writes (the client must join an event split across them).
_TOKEN = {"choices": [{"index": 0, "text": "ab"}]}
_USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
_STREAMS = {
    "/ok": [_event(_TOKEN)[:9], _event(_TOKEN)[9:] + _event(_TOKEN), _event(_TOKEN) + _event(_USAGE),
            b"data: [DONE]\r\n\r\n" + _event(_TOKEN), _event(_TOKEN)],  # nothing after [DONE] counts
    "/no-usage": [_event(_TOKEN), b"data: [DONE]\r\n\r\n"],
    "/stream-error": [_event(_TOKEN), _event({"error": {"message": "engine failed"}})],
    "/not-json": [b"data: {oops\r\n\r\n"],
}


async def _canned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    path = head.split(" ")[1]
    length = next(int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length"))
    await reader.readexactly(length)
    if path == "/bad":
        body = json.dumps({"error": {"message": "max_tokens must be at least 1", "type": "invalid_request_error"}})
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        if path == "/slow":  # nothing more until the client gives up and closes
            await writer.drain()
            await reader.read()
            writer.close()
            return
        for part in _STREAMS.get(path, [_event(_TOKEN)]):
            writer.write(_chunk(part))
            await writer.drain()
            await asyncio.sleep(0.01)
        if path != "/cut":  # /cut drops the connection mid-stream, with no closing chunk
            writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def test_client_times_streams_and_turns_every_failure_into_a_record():
    server = await asyncio.start_server(_canned, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server, session() as http:
        records = {path: await send(http, base + path, {"prompt": "x"}, bench_start=0.0, timeout=1.0)
                   for path in ["/ok", "/bad", "/no-usage", "/stream-error", "/not-json", "/cut", "/slow"]}
        records["refused"] = await send(http, f"http://127.0.0.1:{free_port()}/v1/completions", {}, 0.0, 1.0)
    ok = records.pop("/ok")
    assert ok.success and ok.text == "ababab" and ok.output_tokens == 3 and ok.prompt_tokens == 3
    # Each event is timed when its last byte arrives: the first two complete in the same read.
    assert ok.ttft >= 0.01 and len(ok.itl) == 2 and ok.itl[0] == 0 and ok.itl[1] >= 0.01
    assert records["/bad"].error.startswith("HTTP 400: ") and "max_tokens" in records["/bad"].error
    assert "no usage" in records["/no-usage"].error
    assert records["/stream-error"].error == "stream error: engine failed"
    assert records["/not-json"].error.startswith("JSONDecodeError")
    assert records["/cut"].error.startswith("ClientPayloadError")
    assert records["/slow"].error.startswith("TimeoutError")
    assert records["refused"].error.startswith("ClientConnectorError")
    assert not any(r.success for r in records.values())


def test_a_point_starts_from_an_idle_engine(shared_server):
    """The first /metrics reading of a point waits for the requests before it: a step of theirs that straddled the
    reading would count in full in the point's busy time (a busy share over 1 failed a run)."""
    async def go() -> tuple[bool, dict]:
        async with session() as http:
            url = shared_server.base_url + "/v1/completions"
            earlier = asyncio.create_task(send(http, url, {"prompt": "x", "max_tokens": 48, "ignore_eos": True},
                                               bench_start=0.0, timeout=120.0))
            while not (await engine_metrics(http, shared_server.base_url)).get("num_requests_running"):
                await asyncio.sleep(0.01)
            values = await idle_engine_metrics(http, shared_server.base_url)
            done = earlier.done()
            await earlier
            return done, values

    done, values = asyncio.run(go())
    assert done and values["num_requests_running"] == 0 and values["engine_steps_total"] > 0


def test_short_real_sweep_writes_results_and_plots(tmp_path, shared_server):
    server = shared_server
    save = tmp_path / "results.json"
    bench_main(["--base-url", server.base_url, "--num-prompts", "3", "--input-len", "24", "--output-len", "6",
                "--sweep-concurrency", "1,2", "--save", str(save), "--plot-dir", str(tmp_path / "plots"),
                "--goodput", "ttft:60000", "--temperature", "0.7", "--no-progress"])
    results = json.loads(save.read_text())
    assert set(results) == {"config", "servers", "git_commit", "machine", "axis", "points", "table", "plots",
                            "step_profiles"}
    assert results["axis"] == "concurrency" and results["servers"] == [server.base_url]
    assert len(results["git_commit"]) == 40 and results["machine"]["cpus"] >= 1
    assert results["config"]["input_len"] == 24 and results["config"]["request_rate"] == "inf"
    assert results["config"]["temperature"] == 0.7  # sampled: every step computes the full logits
    assert [p["max_concurrency"] for p in results["points"]] == [1, 2]
    assert [p["num_prompts"] for p in results["points"]] == [3, 4]
    assert [p["seed"] for p in results["points"]] == [0, 1]  # fresh prompts per point: no cross-point cache hits
    for point in results["points"]:
        s = point["summary"]
        assert point["model"] == "SmolLM2-135M-Instruct"
        assert s["completed"] == point["num_prompts"] and s["failed"] == 0
        assert s["total_output_tokens"] == 6 * point["num_prompts"]
        assert 20 <= s["total_input_tokens"] / point["num_prompts"] <= 28  # the server's own count, near 24
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(s[metric]) == {"mean", "median", "p90", "p99"}
            assert 0 < s[metric]["median"] <= s[metric]["p99"]
        assert s["goodput"]["requests"] == point["num_prompts"]
        # the engine's own account of the point, from /metrics before and after it
        profile, engine = point["step_profile"], point["engine"]
        assert engine["device"] == "cpu" and engine["dtype"] in ("float32", "bfloat16") and engine["isa"]
        assert profile["steps"] >= 6 and profile["decodes_per_step"] > 0 and profile["ms_per_step"] > 0
        assert 0 < profile["busy_share"] <= 1.05 and abs(sum(profile["share"].values()) - 1) < 1e-6
        assert 0 < profile["gemm_gflops"] and 0 < profile["gemm_share_of_peak"] < 1.5
        for r in point["requests"]:
            assert r["success"] and r["output_tokens"] == 6 and len(r["itl"]) == 5 and r["text"]
            assert r["ttft"] < r["e2e"] and r["tpot"] > 0
    assert "| concurrency |" in results["table"].splitlines()[0]
    assert len(results["step_profiles"].splitlines()) == 4 and "python+scheduling" in results["step_profiles"]
    for plot in results["plots"]:
        assert (tmp_path / "plots" / plot.rsplit("/", 1)[1]).stat().st_size > 5000

    # --merge: a second engine's run (here the same points, relabelled, at half the throughput) joins the table.
    other = json.loads(save.read_text())
    for point in other["points"]:
        point["label"] = "other"
        point["summary"]["output_throughput"] /= 2
    other_file = tmp_path / "other.json"
    other_file.write_text(json.dumps(other))
    merged = bench_main(["--merge", str(save), str(other_file), "--plot-dir", str(tmp_path / "merged")])
    assert len(merged["points"]) == 4 and "| other | 2 |" in merged["table"]
    ratio_rows = merged["ratios"].splitlines()[2:]
    assert len(ratio_rows) == 2 and all("| other | 2.00 | 1.00 | 1.00 |" in row for row in ratio_rows)
    assert len(merged["plots"]) == 3
    # best against best: per point, the faster of each prefix's servers (the first run is its own group here)
    merged = bench_main(["--merge", str(save), str(other_file), "--best-of", "http", "other"])
    best_rows = merged["best"].splitlines()[2:]
    assert len(best_rows) == 2 and all("| other |" in row and "| 2.00 | 1.00 |" in row for row in best_rows)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_step_profile_prints_every_step_kind(backend, tiny_model, capsys):
    from loadtest.lab.step_profile import main as profile_main

    # The C panels, named: the start-up timing may pick oneDNN on a loaded machine, and its products are not timed
    # as "linear"
    profile_main(["--model", str(tiny_model("llama-gqa-tied")), "--attention-backend", backend, "--batches", "1,3",
                  "--steps", "2", "--prompt-len", "9", "--gemm-kernels", "c"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| decode") or line.startswith("| prefill")]
    assert [r.split("|")[1].strip() for r in rows] == ["decode, batch 1", "decode, batch 3", "prefill, 9 tokens"]
    family = "linear" if backend == "cpu" else "aten::"
    assert all(family in r and "other" in r for r in rows)
    mixed = [line.split("|")[1].strip() for line in out.splitlines() if " decodes + " in line]
    # 2 prompt tokens per decode or waiting request, at least a block (16): the 9-token prompt runs whole beside
    # either batch
    assert mixed == (["1 decodes + 9 prompt tokens", "3 decodes + 9 prompt tokens"] if backend == "cpu" else [])


def test_first_bursts_times_each_burst_in_order(tiny_model, capsys):
    from loadtest.lab.first_bursts import main as bursts_main

    bursts_main(["--model", str(tiny_model("llama-gqa-tied")), "--bursts", "1,3,2", "--prompt-len", "9"])
    rows = [line.split("|")[1:3] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [int(n) for n, _ in rows] == [1, 3, 2] and all(float(ms) > 0 for _, ms in rows)


def test_offline_sweep_runs_points_round_robin_and_reports_each_median(tiny_model, capsys, monkeypatch):
    from loadtest import offline

    calls, point = [], offline.harpoon_sweep_point

    def timed(llm, prompt_ids, new_tokens):
        row = point(llm, [5, 6, 7], new_tokens)  # the tiny model's vocabulary is smaller than the tokenizer's
        calls.append(new_tokens)
        runs = {8: [1.0], 4: [3.0, 1.0, 2.0], 6: [5.0, 9.0, 4.0]}  # 8: the warm-up
        row.ms_per_token = runs[new_tokens][calls.count(new_tokens) - 1]
        return row

    monkeypatch.setattr(offline, "harpoon_sweep_point", timed)
    offline.main(["--model", str(tiny_model("llama-gqa-tied")), "--part", "sweep", "--sweep", "4,6", "--no-hf",
                  "--rounds", "3"])
    assert calls == [8, 4, 6, 4, 6, 4, 6]  # the warm-up, then round-robin
    out = capsys.readouterr().out
    assert "| 4 | " in out and "| 2.0 |" in out and "| 5.0 |" in out  # the medians
    assert "ms/token at 6 new tokens is +150.0% against 4 (per point, the median of 3 runs taken round-robin)" in out
    with pytest.raises(SystemExit):
        offline.main(["--part", "sweep", "--rounds", "0"])


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler")
def test_structured_output_bench_times_both_workloads(tiny_model, capsys):
    from loadtest.lab.structured_output import main as structured_main

    structured_main(["--model", str(tiny_model("llama-gqa-tied")), "--batch", "2", "--max-tokens", "12",
                     "--rounds", "1"])
    out = capsys.readouterr().out
    assert "| 2 | plain |" in out and "| 2 | json_schema |" in out
    assert "compile a fresh 30-property schema" in out and "apply 64 rows' masks" in out


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler")
def test_grammar_compile_bench_times_both_ways_to_compile(tiny_model, capsys):
    from loadtest.lab.grammar_compile import main as grammar_main

    grammar_main(["--model", str(tiny_model("llama-gqa-tied")), "--batch", "2", "--max-tokens", "12", "--join-step",
                  "4", "--rounds", "1"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert [row[1] for row in rows] == ["inline", "thread"]
    assert all(float(cell) > 0 for row in rows for cell in (row[2], row[4], row[5].rstrip(" |")))


def test_kernel_ab_times_each_variant_built_with_its_flags(capsys):
    from loadtest.lab.kernel_ab import main as kernel_ab_main

    with pytest.raises(subprocess.CalledProcessError):  # the flags reach the compiler
        kernel_ab_main(["WORKTREE -DKC=0x", "--rows", "1", "--seqs", "1", "--context", "1", "--rounds", "1"])
    # -Og: ops.c takes ~30 s to build at -O3, ~3 s so (a flag after the engine's -O3 overrides it)
    kernel_ab_main(["WORKTREE", "WORKTREE -Og", "--rows", "3", "--seqs", "2,5", "--context", "40", "--rounds", "2"])
    out = capsys.readouterr().out
    tables = [block.splitlines() for block in out.strip().split("\n\n")]
    assert [t[0] for t in tables] == ["GEMMs of one step (30 layers and the LM head, fp32 panels), 3 rows, 2 threads",
                                      "decode attention of one step (30 layers), 2 sequences x 40 positions",
                                      "decode attention of one step (30 layers), 5 sequences x 40 positions"]
    for t in tables:
        assert [row.split("|")[1].strip() for row in t[3:]] == ["WORKTREE", "WORKTREE -Og"]
        assert t[3].split("|")[4].strip() == "1.000"
    kernel_ab_main(["WORKTREE", "--format", "q4", "--rows", "1", "--seqs", "1", "--context", "1", "--rounds", "1",
                    "--kv-dtype", "float32,bfloat16"])
    out = capsys.readouterr().out
    assert "GEMMs of one step (30 layers and the LM head, q4 panels), 1 rows, 2 threads" in out
    attention = out.strip().split("\n\n")[-1].splitlines()
    assert [row.split("|")[1].strip() for row in attention[3:]] == ["WORKTREE (float32 pool)",
                                                                   "WORKTREE (bfloat16 pool)"]
    with pytest.raises(SystemExit):
        kernel_ab_main(["WORKTREE", "--format", "fp32,q3"])
    with pytest.raises(SystemExit):  # SmolLM2's 576 inputs are no whole K-quant super-block
        kernel_ab_main(["WORKTREE", "--format", "q4_k"])
    kernel_ab_main(["WORKTREE", "--format", "q8_0", "--int8-activations", "--rows", "2", "--seqs", "1", "--context",
                    "1", "--rounds", "1", "--resident", "--threads", "1"])  # a GGUF file's blocks, as the engine packs
    gemm = [t.splitlines()[0] for t in capsys.readouterr().out.strip().split("\n\n")[:2]]  # them, then kept in cache
    assert gemm == ["GEMMs of one step (30 layers and the LM head, q8_0 panels, int8 activations), 2 rows, 1 threads",
                    "GEMMs of one step (30 layers of one layer's weights, each 30 times in a row, q8_0 panels, int8 "
                    "activations), 2 rows, 1 threads"]
    from kernels import cpu

    if "amx" in cpu.bf16_dots():  # BF16A against Q4A panels, interleaved, each a row of the one table
        kernel_ab_main(["WORKTREE", "--format", "amx,q4a", "--rows", "2", "--seqs", "1", "--context", "1",
                        "--rounds", "1"])
        gemm = capsys.readouterr().out.strip().split("\n\n")[0].splitlines()
        assert gemm[0] == "GEMMs of one step (30 layers and the LM head, amx, q4a panels), 2 rows, 2 threads"
        assert [row.split("|")[1].strip() for row in gemm[3:]] == ["WORKTREE (amx panels)", "WORKTREE (q4a panels)"]


def test_int8_gemm_lab_times_both_ways_per_type_and_row_count(capsys):
    from kernels import cpu
    from loadtest.lab.int8_gemm import TYPES
    from loadtest.lab.int8_gemm import main as int8_main

    if not cpu.available() or not cpu.q8x_available():
        pytest.skip("needs the C kernels and u8 x s8 dot products")
    int8_main(["--rows", "1,5", "--shape", "96x512", "--rounds", "1"])
    rows = [line.split("|")[1:3] for line in capsys.readouterr().out.splitlines()[3:]]
    assert [(t.strip(), r.strip()) for t, r in rows] == [(t, r) for t in TYPES for r in ("1", "5")]


def test_gemm_lab_prints_every_candidate_per_shape_and_batch(capsys):
    from loadtest.lab.gemm import main as gemm_main

    gemm_main(["--shapes", "40x64,24x128", "--rows", "1,3"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 40x64") or line.startswith("| 24x128")]
    assert len(rows) == 4 and all(len(r.split("|")) == len(rows[0].split("|")) for r in rows)
    assert all(float(v) > 0 for r in rows for v in r.strip("| ").split(" | ")[2:])
    assert "C fp32 | C bf16" in out and "peak" in out and "ISA:" in out


def test_gguf_pack_lab_times_one_tensor_of_each_block_type(small_q4_k_m, capsys):
    from kernels import cpu
    from loadtest.lab.gguf_pack import main as gguf_pack_main

    if not cpu.available():
        pytest.skip("needs the C kernels")
    gguf_pack_main(["--model", str(small_q4_k_m), "--rounds", "1"])
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines()[3:]]
    tiles = ["Q4_K as Q4KS", "Q6_K as Q6KS"] if "amx" in cpu.bf16_dots() else []  # the fp32 tiles' panels
    assert sorted(rows) == sorted(["Q4_K", "Q6_K", *tiles])
