"""Tensor parallelism on a CPU over gloo (engine/tensor_parallel.py, engine/tp_workers.py): each rank's part of the
weights, greedy tokens at TP=2 and TP=3 equal to one process's with logprobs within 1e-4, and a rank's death
failing the engine fast instead of hanging it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaConfig

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tensor_parallel import SHM_SLOT_ROWS, AllReduce, Shard, make_shm_segment
from kernels import cpu
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs a C compiler")

# No start-up timing; exact GGUF products, as the tokens are compared with transformers.
FAST_START = dict(kv_cache_memory=1 << 24, max_num_batched_tokens=256, gemm_kernels="c", quantized_matmul="exact")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _config(heads: int = 4, kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=16, num_hidden_layers=1, vocab_size=32)


def _checkpoint(config: LlamaConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    weights = {f"model.layers.0.{'mlp' if 'p_proj' in n or 'down' in n else 'self_attn'}.{n}.weight": torch.randn(s)
               for n, s in shapes.items()}
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.randn(hidden)
    weights["model.norm.weight"] = torch.randn(hidden)
    return weights


def _parts(config: LlamaConfig, size: int) -> list[dict[str, torch.Tensor]]:
    checkpoint = _checkpoint(config)
    return [dict(Shard(rank, size, config).weights(iter(checkpoint.items()))) for rank in range(size)]


def test_the_ranks_parts_make_up_each_layer():
    config = _config()
    whole, parts = _checkpoint(config), _parts(config, 2)
    for name, tensor in whole.items():
        layer = name.split(".")[-2]
        if layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # outputs split
            assert torch.equal(torch.cat([p[name] for p in parts]), tensor)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # inputs split: partial sums
            assert torch.equal(torch.cat([p[name] for p in parts], dim=1), tensor)
        else:  # norms, and the bias added once after the sum
            assert all(torch.equal(p[name], tensor) for p in parts)
    model_config = Shard(1, 2, config).model_config()
    assert (model_config.num_attention_heads, model_config.num_key_value_heads, model_config.intermediate_size,
            model_config.head_dim, model_config.hidden_size) == (2, 1, 64, 16, 64)


def test_kv_heads_fewer_than_the_ranks_are_replicated_with_their_query_heads():
    config = _config(heads=4, kv_heads=2)
    k = _checkpoint(config)["model.layers.0.self_attn.k_proj.weight"]
    parts = _parts(config, 4)  # query heads 0,1 use KV head 0; query heads 2,3 use KV head 1
    for rank, part in enumerate(parts):
        head = rank // 2
        assert torch.equal(part["model.layers.0.self_attn.k_proj.weight"], k[head * 16:(head + 1) * 16])


@pytest.mark.parametrize(("heads", "kv_heads", "size", "message"), [
    (9, 3, 2, "does not divide its 9 attention heads"),  # SmolLM2-135M at TP=2
    (8, 3, 4, "its 3 KV heads"),
])
def test_a_split_that_does_not_divide_the_model_is_refused(heads, kv_heads, size, message):
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=heads,
                         num_key_value_heads=kv_heads)
    with pytest.raises(ValueError, match=message):
        Shard(0, size, config)


def _sum_on_rank(rank: int, size: int, folder: str, results) -> None:
    """One rank of ``test_both_ways_to_sum_give_every_rank_the_rank_order_sum``."""
    all_reduce = AllReduce(f"{folder}/store", f"{folder}/sums", rank, size, torch.device("cpu"), 8, lambda: True)
    torch.manual_seed(rank)
    mine = torch.randn(SHM_SLOT_ROWS + 44, 8)  # more rows than a slot: the shared-memory sum goes in two pieces
    for way, run in (("gloo", all_reduce._group_sum), ("shm", all_reduce.shm)):
        x = mine.clone()
        run(x)
        results[(way, rank)] = x
    results[("chosen", rank)] = all_reduce.way


def test_both_ways_to_sum_give_every_rank_the_rank_order_sum(tmp_path):
    size = 3
    make_shm_segment(str(tmp_path / "sums"), size, 8)
    context = torch.multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        torch.multiprocessing.start_processes(_sum_on_rank, args=(size, str(tmp_path), results), nprocs=size,
                                              start_method="spawn")
        results = dict(results)
    parts = []
    for rank in range(size):
        torch.manual_seed(rank)
        parts.append(torch.randn(SHM_SLOT_ROWS + 44, 8))
    expected = parts[0] + parts[1] + parts[2]
    for rank in range(size):
        assert torch.equal(results[("shm", rank)], expected)  # the same bits on every rank
        assert torch.allclose(results[("gloo", rank)], expected, atol=1e-6)
    assert len({results[("chosen", rank)] for rank in range(size)}) == 1  # rank 0's verdict, taken by all


def _greedy(model: str | None, prompts: list, size: int, params: SamplingParams = GREEDY,
            **engine_args) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(model, tensor_parallel_size=size, **{**FAST_START, **engine_args})
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()
    return [o.token_ids for o in outputs], [[next(iter(p.values())).logprob for p in o.logprobs] for o in outputs]


def _assert_same_greedy(one: tuple, split: tuple) -> None:
    assert split[0] == one[0]
    worst = max(abs(a - b) for x, y in zip(one[1], split[1], strict=True) for a, b in zip(x, y, strict=True))
    assert worst < 1e-4


# a tied Llama with GQA, Qwen3 (q/k norms, untied), Mistral's single KV head (replicated on both ranks), and
# mixtures of experts, each expert split by its columns (Qwen2-MoE's shared expert too, and its dense layer 0)
@pytest.mark.parametrize("kind", ["llama-gqa-tied", "qwen3-qknorm", "mistral", "qwen2-moe-shared", "mixtral"])
def test_two_ranks_give_one_process_greedy_tokens(tiny_model, kind):
    path = str(tiny_model(kind))
    prompts = [[1, 5, 9, 30, 44, 100], list(range(3, 60, 2))]
    _assert_same_greedy(_greedy(path, prompts, 1), _greedy(path, prompts, 2))


def test_smollm2_over_its_three_kv_heads_gives_transformers_greedy_tokens(prompt_ids, hf_smollm2):
    """The default model's GGUF blocks, split three ways (its o_proj and down_proj inputs cut between blocks). One
    process's tokens are transformers' (test_smollm2_greedy.py), so these are one process's too."""
    prompts = prompt_ids[:4]
    tokens, _ = _greedy(None, prompts, 3, SamplingParams(temperature=0, max_tokens=12, logprobs=0))
    assert tokens == [hf_greedy(hf_smollm2, p, 12) for p in prompts]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
def test_two_gpus_give_one_gpus_greedy_tokens(tiny_model):
    path, prompts = str(tiny_model("qwen3-qknorm")), [[1, 5, 9, 30, 44, 100], list(range(3, 60, 2))]
    one, split = (_greedy(path, prompts, size, device="cuda", dtype="float32") for size in (1, 2))
    _assert_same_greedy(one, split)


def test_a_rank_that_died_fails_the_sums_and_the_next_step_instead_of_hanging(tiny_model):
    """A rank that dies mid-step: the engine's next all-reduce raises once the rank's socket closes; between steps:
    the check before the next step names it."""
    llm = LLM(str(tiny_model("llama-gqa-tied")), tensor_parallel_size=2, **FAST_START)
    try:
        workers = llm.engine.tp_workers
        workers.processes[0].kill()
        workers.processes[0].wait()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel sum failed on rank 0"):
            workers.all_reduce(torch.zeros(4, 64))
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 died"):
            llm.generate([[1, 2, 3]], GREEDY)
    finally:
        llm.engine.close()


_ENGINE_THAT_PRINTS_ITS_RANKS = f"""
import sys, time
sys.path.insert(0, {os.getcwd()!r})
from engine.llm import LLM
llm = LLM({{model!r}}, tensor_parallel_size=2, **{FAST_START!r})
print(*[p.pid for p in llm.engine.tp_workers.processes], flush=True)
time.sleep(600)
"""


def test_the_ranks_end_with_a_killed_engine_process(tiny_model):
    """The server's engine process killed (the OOM killer, the watchdog): its ranks do not outlive it."""
    script = _ENGINE_THAT_PRINTS_ITS_RANKS.replace("{model!r}", repr(str(tiny_model("llama-gqa-tied"))))
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert len(pids) == 1
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_running(pid) for pid in pids)
    finally:
        engine.kill()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped by init, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
