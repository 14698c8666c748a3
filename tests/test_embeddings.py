"""Embedding models (the pooling runner): a tiny random checkpoint in each of the sentence-transformers poolings gives
transformers' vectors (its last_hidden_state pooled and normalized as the checkpoint's modules say), alone, batched
and chunked over several steps; a causal LM served with runner="pooling"; and the served /v1/embeddings with its
encodings, Matryoshka dimensions and bad input."""

import base64
import json
import struct

import httpx
import pytest
import torch

from engine.llm import LLM
from tests.server_process import ServerProcess

PROMPTS = [[1, 17, 45, 99, 250, 7], [3] * 40 + [9, 8], [5], list(range(3, 70))]  # (2 is the pad token: zeros)
ST_POOLING = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def build_embedding_model(folder, tokenizer, pooling: str, normalize: bool, matryoshka: bool = False,
                          architecture: str = "Qwen3Model", vocab_size: int = 512):
    """A 2-layer random Qwen3 base model with sentence-transformers' module files, as Qwen3-Embedding ships."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=256, initializer_range=0.25, tie_word_embeddings=True,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if matryoshka:
        config.is_matryoshka = True
    torch.manual_seed(7)
    make = AutoModel if architecture == "Qwen3Model" else AutoModelForCausalLM
    model = make.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **dict.fromkeys(ST_POOLING.values(), False), ST_POOLING[pooling]: True}))
    return folder


def reference(folder, prompts: list[list[int]], pooling: str, normalize: bool) -> list[torch.Tensor]:
    """transformers' hidden states, pooled and normalized by hand, one prompt at a time."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    vectors = []
    for ids in prompts:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
        vectors.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return vectors


def assert_close(ours: list[list[float]], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        a = torch.tensor(a)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.9999
        assert torch.allclose(a.norm(), b.norm(), rtol=1e-4)


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", True), ("cls", False)])
def test_vectors_equal_transformers_pooled_batched_and_chunked(tmp_path, smollm2_tokenizer, pooling, normalize):
    folder = build_embedding_model(tmp_path, smollm2_tokenizer, pooling, normalize)
    theirs = reference(folder, PROMPTS, pooling, normalize)
    batched = LLM(str(folder), max_model_len=256, gemm_kernels="c")
    assert batched.engine.pooling.kind == pooling and batched.engine.pooling.normalize == normalize
    assert_close(batched.embed(PROMPTS), theirs)
    assert_close([batched.embed([p])[0] for p in PROMPTS], theirs)
    chunked = LLM(str(folder), max_model_len=256, gemm_kernels="c", max_num_batched_tokens=16)
    assert_close(chunked.embed(PROMPTS), theirs)
    assert chunked.engine.block_manager.num_free_blocks == chunked.engine.block_manager.num_blocks


def test_a_causal_lm_served_as_an_embedding_model(tmp_path, smollm2_tokenizer):
    folder = build_embedding_model(tmp_path, smollm2_tokenizer, "last", True, architecture="Qwen3ForCausalLM")
    (folder / "modules.json").unlink()  # nothing says it embeds: it generates unless asked
    assert LLM(str(folder), max_model_len=256, gemm_kernels="c").engine.pooling is None
    forced = LLM(str(folder), max_model_len=256, gemm_kernels="c", runner="pooling")
    assert_close(forced.embed(PROMPTS[:2]), reference(folder, PROMPTS[:2], "last", True))  # last token, normalized


def test_a_gguf_embedding_model_pools_as_its_metadata_says(tmp_path):
    from transformers import AutoModel

    from engine.model_loader import gguf_to_folder
    from loadtest.models import Shape, write_model

    shape = Shape("llama", 128, 256, 2, 4, 2, 49160, 10000.0, 512, tied=True)
    path = write_model(shape, "q8_0", tmp_path / "embed-q8_0.gguf", seed=3, pooling_type=1)  # mean
    llm = LLM(str(path), max_model_len=256, quantized_matmul="exact", gemm_kernels="c")
    assert (llm.engine.pooling.kind, llm.engine.pooling.normalize) == ("mean", True)
    model = AutoModel.from_pretrained(gguf_to_folder(path), dtype=torch.float32).eval()
    theirs = []
    for ids in PROMPTS:
        with torch.no_grad():
            theirs.append(torch.nn.functional.normalize(model(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=0))
    assert_close(llm.embed(PROMPTS), theirs)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer):
    folder = build_embedding_model(tmp_path_factory.mktemp("embed"), smollm2_tokenizer, "mean", True,
                                   matryoshka=True, vocab_size=len(smollm2_tokenizer))
    s = ServerProcess("--model", str(folder), "--max-model-len", "256")
    s.folder = folder
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_served_embeddings_in_both_encodings_and_matryoshka_sizes(server):
    texts = ["hello world", "a longer sentence about the weather in Paris", "x"]
    r = post(server, "/v1/embeddings", {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [httpx.post(f"{server.base_url}/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    for vector, theirs in zip(body["data"], reference(server.folder, ids, "mean", True), strict=True):
        assert_close([vector["embedding"]], [theirs])
    encoded = post(server, "/v1/embeddings", {"input": texts[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(body["data"][0]["embedding"], abs=1e-6)
    cut = post(server, "/v1/embeddings", {"input": [ids[1]], "dimensions": 16}).json()["data"][0]["embedding"]
    expected = torch.nn.functional.normalize(torch.tensor(body["data"][1]["embedding"][:16]), dim=0)
    assert len(cut) == 16 and torch.allclose(torch.tensor(cut), expected, atol=1e-5)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [[1, 99999]]}, "input"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
])
def test_bad_embedding_requests_get_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_generative_server_refuses_embeddings(shared_server):
    r = post(shared_server, "/v1/embeddings", {"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
