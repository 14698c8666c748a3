"""engine/backends/panel_cache.py: a GGUF file's or a checkpoint folder's panels packed once, kept in a cache file
and mapped at the next start; never the wrong panels, whatever changed in between."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.backends import amx_blocks, panel_cache
from engine.backends import cpu as cpu_backend
from engine.backends.panel_cache import PanelCache
from engine.engine_core import EngineCore
from engine.gguf_weights import iter_gguf_weights
from engine.kernel_plan import KernelChoice, PlanRow
from engine.llm import LLM
from engine.models.linear import Linear
from engine.models.llama import LlamaForCausalLM
from engine.models.quantized import FileBlocks
from engine.sampling_params import SamplingParams
from kernels import cpu
from tests.test_pages import mapped_file

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")


@pytest.fixture
def counted_packs(monkeypatch) -> list[int]:
    """Every weight packed from the file's bytes from now on (not mapped), counted."""
    packs = []
    # each kind's panels, and the fp32 tiles' (split_panels)
    for name in ("pack_gguf_rows", "pack_gguf_widened", "pack_gguf_ksplit"):
        pack = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *args, pack=pack, **kwargs: packs.append(1) or pack(*args, **kwargs))
    monkeypatch.setattr(panel_cache, "MIN_BYTES", 0)  # the small test model's panels cached too
    return packs


def blocks_of(path, names: int = 3) -> list[FileBlocks]:
    """The first block weights of the file, as the loader hands them to a backend."""
    found = [w for _, w in iter_gguf_weights(str(path), 4, 2) if isinstance(w, FileBlocks)]
    return found[:names]


def cache_of(path, root) -> PanelCache:
    return PanelCache(path, root, cpu.panel_layout())


def pack_all(cache: PanelCache, weights: list[FileBlocks]) -> list[torch.Tensor]:
    return [cpu_backend._pack_quantized(w, cache) for w in weights]


@pytest.mark.parametrize("on_tiles", [True, False], ids=["q4-on-amx", "q4-on-fmas"])
def test_a_second_start_maps_the_panels_the_first_packed_and_serves_the_same_tokens(small_q4_k_m, tmp_path,
                                                                                    monkeypatch, counted_packs,
                                                                                    on_tiles):
    monkeypatch.setattr(cpu_backend, "cache_root", lambda: tmp_path)
    # both starts take the same body for the blocks where AMX offers one (fp32 on tiles, Q4KS/Q6KS; else the FMAs),
    # whatever their timing reads: each start packs or maps the panels of the body it took
    monkeypatch.setattr(amx_blocks, "faster", lambda _: on_tiles)
    options = dict(max_model_len=256, kv_cache_memory=16 << 20, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    first = LLM(str(small_q4_k_m), **options)
    packed = len(counted_packs)
    assert packed > 0 and first.engine.backend.mapped_weight_bytes() == 0
    first.engine.backend.panel_cache.wait()  # written while the engine serves
    files = sorted(p.suffix for p in (tmp_path / "panels").iterdir())
    assert files == [".bin", ".json"]
    tokens = first.generate(["Hello there", "Once upon"], params)
    panels = first.engine.model.layers[0].mlp.down_proj.kernel.packed.clone()
    del first

    second = LLM(str(small_q4_k_m), **options)
    assert len(counted_packs) == packed  # nothing packed: every weight mapped
    backend = second.engine.backend
    assert backend.split_body == (("tiles" if on_tiles else "FMAs") if "amx" in cpu.bf16_dots() else None)
    assert backend.mapped_weight_bytes() == (tmp_path / "panels" / backend.panel_cache.data_path.name).stat().st_size
    mapped = second.engine.model.layers[0].mlp.down_proj.kernel.packed
    assert torch.equal(mapped.view(torch.uint8), panels.view(torch.uint8))  # as bytes: a Q6S weight's type has no ==
    again = second.generate(["Hello there", "Once upon"], params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in tokens]
    del second

    LLM(str(small_q4_k_m), panel_cache=False, **options)  # --no-panel-cache: packed, the cache neither read nor made
    assert len(counted_packs) == 2 * packed


def test_the_first_start_serves_before_its_cache_file_is_written(small_q4_k_m, tmp_path, monkeypatch, counted_packs):
    """The cache file is written by a thread of its own, started once the start-up's timings are taken: the engine
    serves while the write is held up, and the file is whole once it is let go."""
    monkeypatch.setattr(cpu_backend, "cache_root", lambda: tmp_path)
    let_go, write = threading.Event(), panel_cache._HugePageWriter.write

    def held(self, data) -> None:  # until let go (or 20 s on: then the rest unheld)
        let_go.wait(20)
        let_go.set()
        write(self, data)

    monkeypatch.setattr(panel_cache._HugePageWriter, "write", held)
    writing_at_warm_up, warm_up = [], EngineCore._warm_up

    def timed_start(self) -> None:  # the start-up's timings run with no write beside them
        writing_at_warm_up.append(any(t.name == "panel-cache-writer" for t in threading.enumerate()))
        warm_up(self)

    monkeypatch.setattr(EngineCore, "_warm_up", timed_start)
    llm = LLM(str(small_q4_k_m), max_model_len=256, kv_cache_memory=16 << 20)
    assert writing_at_warm_up == [False]
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert not list((tmp_path / "panels").glob("*.json")) and not let_go.is_set()  # served, the file not yet made
    let_go.set()
    llm.engine.backend.panel_cache.wait()
    assert sorted(p.suffix for p in (tmp_path / "panels").iterdir()) == [".bin", ".json"]


def test_a_first_starts_panels_are_read_from_its_cache_files_pages_once_written(small_q4_k_m, tmp_path,
                                                                              counted_packs):
    """Packed into an arena whose bytes open the file; once it is written, the same tensors lie in the file's pages
    at the same addresses, and a later start maps the same bytes from the offsets the index names."""
    weights = blocks_of(small_q4_k_m)
    cache = cache_of(small_q4_k_m, tmp_path)
    packed = pack_all(cache, weights)
    expected = [p.clone() for p in packed]
    addresses = [p.data_ptr() for p in packed]
    assert {mapped_file(a) for a in addresses} == {""}  # fresh memory while packing
    cache.finish()
    assert {mapped_file(a) for a in addresses} == {str(cache.data_path)}
    assert [p.data_ptr() for p in packed] == addresses
    assert all(torch.equal(p, e) for p, e in zip(packed, expected, strict=True))

    later = cache_of(small_q4_k_m, tmp_path)
    assert all(torch.equal(p, e) for p, e in zip(pack_all(later, weights), expected, strict=True))
    assert len(counted_packs) == len(weights)  # mapped, not packed


def test_panels_of_other_rows_are_packed_not_mapped_and_the_file_made_again(small_q4_k_m, tmp_path, counted_packs):
    weights = blocks_of(small_q4_k_m)
    cache = cache_of(small_q4_k_m, tmp_path)
    fresh = pack_all(cache, weights)
    cache.finish()
    assert len(counted_packs) == len(weights)

    cache = cache_of(small_q4_k_m, tmp_path)
    assert [torch.equal(a, b) for a, b in zip(pack_all(cache, weights), fresh, strict=True)] == [True] * len(weights)
    assert len(counted_packs) == len(weights) and cache.mapped_bytes > 0
    cache.finish()  # all were there: nothing written
    reversed_rows = weights[0].rows(torch.arange(weights[0].shape[0]).flip(0))  # same type, width and tensor
    [panels] = pack_all(cache, [reversed_rows])
    assert len(counted_packs) == len(weights) + 1  # packed, not the cached panels of the rows in file order
    assert torch.equal(panels, cpu.pack_gguf_rows(reversed_rows.type_id, reversed_rows.addresses(),
                                                  reversed_rows.in_features))
    cache.finish()

    cache = cache_of(small_q4_k_m, tmp_path)  # the new file holds all four
    pack_all(cache, [*weights, reversed_rows])
    assert len(counted_packs) == len(weights) + 2


def test_a_cut_short_cache_file_is_not_mapped_and_is_made_again(small_q4_k_m, tmp_path, counted_packs):
    weights = blocks_of(small_q4_k_m)
    cache = cache_of(small_q4_k_m, tmp_path)
    # copies: once written, the file's pages are the first start's panels, and a file cut in place under a mapping
    # faults (SIGBUS) where it is read past the cut; Harpoon replaces its files whole, never cuts one in place
    fresh = [t.clone() for t in pack_all(cache, weights)]
    cache.finish()
    size = cache.data_path.stat().st_size
    os.truncate(cache.data_path, size // 2)

    cache = cache_of(small_q4_k_m, tmp_path)
    assert cache.mapped_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(pack_all(cache, weights), fresh, strict=True))
    assert len(counted_packs) == 2 * len(weights)
    cache.finish()
    assert cache.data_path.stat().st_size == size


def test_a_changed_gguf_file_gets_a_cache_file_of_its_own_and_the_old_one_goes(small_q4_k_m, tmp_path,
                                                                              counted_packs):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(small_q4_k_m.read_bytes())
    weights = blocks_of(gguf)
    old = cache_of(gguf, tmp_path)
    pack_all(old, weights)
    old.finish()
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place, say

    new = cache_of(gguf, tmp_path)
    assert new.data_path != old.data_path and new.mapped_bytes == 0
    pack_all(new, blocks_of(gguf))
    assert len(counted_packs) == 2 * len(weights)
    new.finish()
    assert sorted(p.name for p in (tmp_path / "panels").iterdir()) == sorted(
        [new.data_path.name, new.index_path.name])


def test_the_kv_pool_budget_leaves_out_the_mapped_panels(monkeypatch):
    backend = cpu_backend.CpuBackend.__new__(cpu_backend.CpuBackend)
    backend.config = type("Config", (), {"kv_cache_memory": 0.5})()
    backend.device = torch.device("cpu")
    backend.panel_cache = type("Mapped", (), {"mapped_bytes": 6 << 30})()
    monkeypatch.setattr("engine.backends.base.available_memory", lambda device: 20 << 30)
    assert backend.kv_cache_bytes() == 7 << 30  # half of the 14 GiB the panels' pages leave


def test_an_index_entry_that_does_not_fit_the_file_is_packed_anew(small_q4_k_m, tmp_path, counted_packs):
    weights = blocks_of(small_q4_k_m, names=2)
    cache = cache_of(small_q4_k_m, tmp_path)
    fresh = pack_all(cache, weights)
    cache.finish()
    index = json.loads(cache.index_path.read_text())
    first = next(iter(index["entries"].values()))
    first["offset"] = index["bytes"]  # past the end
    cache.index_path.write_text(json.dumps(index))

    cache = cache_of(small_q4_k_m, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(pack_all(cache, weights), fresh, strict=True))
    assert len(counted_packs) == len(weights) + 1  # the one that did not fit, packed


def test_the_older_file_of_a_source_goes_before_the_disks_room_is_counted(small_q4_k_m, tmp_path, counted_packs,
                                                                          monkeypatch):
    """A start of another panel layout (a new build) on a disk with room for one model's panels: the older file
    would go once the new one is written, so it goes first, and the new one is written."""
    weights = blocks_of(small_q4_k_m)
    old = PanelCache(small_q4_k_m, tmp_path, "layout-a")
    pack_all(old, weights)
    old.finish()
    assert old.data_path.exists()
    new = PanelCache(small_q4_k_m, tmp_path, "layout-b")
    pack_all(new, weights)
    seen = []

    def disk_usage(_: object) -> SimpleNamespace:  # room for one model's panels: none while the old file is there
        seen.append(old.data_path.exists())
        return SimpleNamespace(free=0 if seen[-1] else 1 << 62)

    monkeypatch.setattr(panel_cache.shutil, "disk_usage", disk_usage)
    new.finish()
    assert seen == [False] and new.data_path.exists() and new.index_path.exists()
    assert sorted(p.name for p in (tmp_path / "panels").iterdir()) == sorted(
        [new.data_path.name, new.index_path.name])


def test_a_cache_that_cannot_be_written_leaves_the_panels_packed_and_nothing_behind(small_q4_k_m, tmp_path,
                                                                                      counted_packs, caplog):
    root = tmp_path / "root"
    root.mkdir()
    (root / "panels").write_text("a file where the folder would be")
    cache = cache_of(small_q4_k_m, root)
    weights = blocks_of(small_q4_k_m, names=2)
    fresh = pack_all(cache, weights)
    cache.finish()  # logs and goes on
    assert "panels not cached" in caplog.text and len(fresh) == 2
    assert sorted(p.name for p in root.iterdir()) == ["panels"]


def test_files_left_half_written_by_a_stopped_writer_are_removed_and_a_running_ones_kept(small_q4_k_m, tmp_path,
                                                                                          counted_packs, monkeypatch):
    folder = tmp_path / "panels"
    folder.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    stopped, running = folder / f".tmp-{gone.pid}-abc.bin", folder / f".tmp-{os.getpid()}-def.bin"
    stopped.write_bytes(b"half")
    running.write_bytes(b"half")
    # the disk is full until the stopped writer's file goes: it must go before the free space is counted
    monkeypatch.setattr(panel_cache.shutil, "disk_usage",
                        lambda path: SimpleNamespace(free=0 if stopped.exists() else 1 << 50))
    cache = cache_of(small_q4_k_m, tmp_path)
    pack_all(cache, blocks_of(small_q4_k_m, names=1))
    cache.finish()
    assert not stopped.exists() and running.exists() and cache.data_path.exists()


PROMPT_IDS = [[5, 6, 7, 8], [300, 2, 41]]  # the tiny models' vocabulary is 512 tokens


def _packed_weights(model) -> dict[str, torch.Tensor]:
    """Every module's panels: the projections', the LM head's and the embedding lookups'."""
    return {name: module.kernel.packed for name, module in model.named_modules()
            if isinstance(getattr(module, "kernel", None), (cpu_backend.PackedLinear, cpu_backend.PackedEmbedding))}


@pytest.mark.parametrize(("dtype", "stored"), [("bfloat16", "float32"), ("float32", "float32"),
                                              ("float32", "bfloat16")])
def test_a_dense_checkpoints_panels_are_mapped_at_the_second_start_until_a_weight_file_changes(
        tiny_model, tmp_path, monkeypatch, dtype, stored):
    """A folder of safetensors (untied: its head, and in bfloat16 its embedding's lookups, have panels of their own)
    packs at its first start, maps every panel at the next and serves the same tokens; a rewritten weight file packs
    anew. A bfloat16 checkpoint served in fp32 has BF16 panels, packed with nothing let go in the arena."""
    monkeypatch.setattr(panel_cache, "MIN_BYTES", 0)
    monkeypatch.setattr(cpu_backend, "cache_root", lambda: tmp_path)
    # every start takes the bodies the first one timed fastest: in bfloat16 the body decides the panels (BF16A for
    # AMX, else BF16C), and a near tie timed again under load had the second start pack the other kind
    chosen, decide = {}, KernelChoice.decide

    def first_choice(choice: KernelChoice) -> PlanRow:
        if choice.name not in chosen:
            chosen[choice.name] = decide(choice)
        return chosen[choice.name]

    monkeypatch.setattr(KernelChoice, "decide", first_choice)
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_model("llama-mha-untied-llama3-rope").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    if stored == "bfloat16":
        for shard in folder.glob("*.safetensors"):
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    options = dict(dtype=dtype, kv_cache_memory=4 << 20, max_num_batched_tokens=64, gemm_kernels="c")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    read, dense_weight = [], Linear.dense_weight  # the linear layers whose checkpoint tensors were read
    monkeypatch.setattr(Linear, "dense_weight", lambda self: read.append(self) or dense_weight(self))

    def names_read(model) -> set[str]:
        return {name for name, module in model.named_modules() if any(module is r for r in read)}

    first = LLM(str(folder), **options)
    assert first.engine.backend.mapped_weight_bytes() == 0
    assert {"lm_head", "layers.1.self_attn.qkv_proj", "layers.1.mlp.down_proj"} <= names_read(first.engine.model)
    cache = first.engine.backend.panel_cache
    cache.wait()
    in_arena = [t for t in cache._used.values() if cache._arena.offset_of(t) is not None]
    assert in_arena and cache._arena.used == sum(-(-t.nbytes // 4096) * 4096 for t in in_arena)  # nothing let go
    tokens = [o.outputs[0].token_ids for o in first.generate(PROMPT_IDS, params)]
    panels = {name: p.clone() for name, p in _packed_weights(first.engine.model).items()}
    # (fp32 lookups read the table itself: its random values are no 4- or 8-bit blocks, so it has no panels)
    assert {"lm_head", "layers.1.mlp.down_proj", *(["embed_tokens"] if dtype == "bfloat16" else [])} <= panels.keys()
    del first

    read.clear()
    unread, load = [], LlamaForCausalLM.load_weights  # each linear layer's weight as the backend first gets it

    def loaded(self, weights, lazy=False):
        load(self, weights, lazy)
        unread.extend((name, m.weight.is_meta, [mapped_file(t.data_ptr()) for t in m.parts or ()])
                      for name, m in self.named_modules() if isinstance(m, Linear) and m is not self.lm_head)

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", loaded)
    second = LLM(str(folder), **options)
    # every one still in the checkpoint's files (nothing copied), q/k/v and gate/up as their own tensors
    assert unread and all(meta and files and all(f.startswith(str(folder)) for f in files)
                          for _, meta, files in unread)
    assert {len(files) for name, _, files in unread if name.endswith("qkv_proj")} == {3}
    # only the first layer's, which start-up times the products with: the others' panels are mapped unread
    assert names_read(second.engine.model) <= {f"layers.0.{m}" for m in
                                               ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                "mlp.down_proj")}
    cache = second.engine.backend.panel_cache
    start = torch.frombuffer(cache._mapping, dtype=torch.uint8).data_ptr()
    mapped = _packed_weights(second.engine.model)
    assert mapped.keys() == panels.keys()
    for name, p in mapped.items():
        assert torch.equal(p, panels[name]) and start <= p.data_ptr() < start + cache.mapped_bytes, name
    assert [o.outputs[0].token_ids for o in second.generate(PROMPT_IDS, params)] == tokens
    del second

    shard = next(folder.glob("*.safetensors"))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place, say
    third = LLM(str(folder), **options)
    assert third.engine.backend.mapped_weight_bytes() == 0
    third.engine.backend.panel_cache.wait()
    del third
    assert len(list((tmp_path / "panels").glob("*.bin"))) == 1  # the old file went with the new one's writing
