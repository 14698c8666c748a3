"""Embedding throughput: Harpoon's /v1/embeddings at N clients against the same model through sentence-transformers
in one process, on the same machine, one after the other.

    python -m loadtest.embeddings [--model FOLDER] [--clients 16] [--requests 256] [--tokens 128]

The model is the random-weight Qwen3-Embedding-0.6B shape from loadtest/models.py (bf16 safetensors) unless
``--model`` names another folder with sentence-transformers files; both sides encode the same texts, each
``--tokens`` tokens long (the same tokenizer on both sides). sentence-transformers runs as it loads by default (the
checkpoint's dtype) and in fp32, in batches of each of ``--batch-sizes``, its best kept (on ``--st-texts`` of the
texts: its rate is per sequence); Harpoon serves one text a request from ``--clients`` clients in its default dtype
(``auto``: on a CPU, bf16 only where bf16 products measured faster). Prints sequences/s of each and the ratios, and
checks that the vectors agree (cosine against the fp32 run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from loadtest.models import cached_model
from loadtest.processes import start, stop, wait_healthy
from loadtest.serve import machine


def texts_of(tokenizer: object, num: int, num_tokens: int, seed: int = 0) -> list[str]:
    """``num`` texts that tokenize to ``num_tokens`` tokens each (random words of the vocabulary's plain pieces)."""
    rng = np.random.default_rng(seed)
    words = [w for w in (tokenizer.decode([i]) for i in range(1000, 20000)) if w.strip().isalpha()]
    texts = []
    while len(texts) < num:
        text = "".join(rng.choice(words, size=num_tokens * 2))
        ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text, add_special_tokens=False)) == num_tokens:
            texts.append(text)
    return texts


def sentence_transformers_rate(folder: Path, texts: list[str], batch_sizes: list[int], dtype: str
                               ) -> tuple[float, int, list]:
    """The best sequences/s of sentence-transformers' ``encode`` over the batch sizes, that batch size, and its
    vectors; ``dtype``: "auto" (as it loads by default) or "float32"."""
    import torch
    from sentence_transformers import SentenceTransformer

    kwargs = {"model_kwargs": {"dtype": torch.float32}} if dtype == "float32" else {}
    model = SentenceTransformer(str(folder), device="cpu", **kwargs)
    model.encode(texts[:8], batch_size=8)  # warm up
    best = (0.0, 0, [])
    for batch in batch_sizes:
        start = time.perf_counter()
        vectors = model.encode(texts, batch_size=batch, convert_to_numpy=True)
        rate = len(texts) / (time.perf_counter() - start)
        if rate > best[0]:
            best = (rate, batch, vectors)
    return best


async def harpoon_rate(url: str, texts: list[str], clients: int) -> tuple[float, list]:
    queue = list(enumerate(texts))
    vectors: dict[int, list[float]] = {}

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            i, text = queue.pop()
            async with http.post(url + "/v1/embeddings", json={"input": text}) as r:
                r.raise_for_status()
                vectors[i] = (await r.json())["data"][0]["embedding"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async with http.post(url + "/v1/embeddings", json={"input": texts[:clients]}) as r:  # warm up
            r.raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - start
    return len(texts) / elapsed, [vectors[i] for i in range(len(texts))]


def isa() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "avx2") if f" {f}" in flags]
    return " ".join(names)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--st-texts", type=int, default=32, help="0: Harpoon alone")
    parser.add_argument("--server-args", default="", help="more flags for harpoon serve")
    parser.add_argument("--port", type=int, default=8733)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    folder = Path(args.model) if args.model else cached_model("qwen3-embedding-0.6b", "bf16")
    from transformers import AutoTokenizer

    texts = texts_of(AutoTokenizer.from_pretrained(folder), args.requests, args.tokens)
    st_texts = texts[: args.st_texts]
    st_rate, st_batch, st_vectors, default_rate, default_batch = float("nan"), 0, [], float("nan"), 0
    if st_texts:
        st_rate, st_batch, st_vectors = sentence_transformers_rate(folder, st_texts, args.batch_sizes, "float32")
        default_rate, default_batch, _ = sentence_transformers_rate(folder, st_texts, args.batch_sizes[:1], "auto")
    log = Path("/tmp/harpoon-embeddings.log")
    proc = start([sys.executable, "-m", "server", "--model", str(folder), "--port", str(args.port),
                  "--max-num-seqs", str(args.clients), "--max-model-len", "2048", *args.server_args.split()], log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc, log)
        rate, vectors = asyncio.run(harpoon_rate(url, texts, args.clients))
    finally:
        stop([proc])
    serving = next((line for line in log.read_text().splitlines() if " serving " in line), "")
    served_dtype = "bfloat16" if "bfloat16" in serving else "float32"
    ours, theirs = np.asarray(vectors[: len(st_vectors)]), np.asarray(st_vectors)
    cosine = (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)) \
        if st_texts else np.array([float("nan")])
    result = {"model": str(folder), "tokens": args.tokens, "requests": args.requests, "clients": args.clients,
              "harpoon_dtype": served_dtype, "harpoon_seq_s": rate, "st_fp32_seq_s": st_rate, "st_fp32_batch": st_batch,
              "st_default_seq_s": default_rate, "st_default_batch": default_batch,
              "min_cosine": float(cosine.min()), "isa": isa(), "machine": machine()}
    print(f"texts of {args.tokens} tokens ({args.requests} to Harpoon, {len(st_texts)} to sentence-transformers), "
          f"{isa()}")
    print("| engine | sequences/s | Harpoon's ratio |\n|---|---:|---:|")
    print(f"| Harpoon /v1/embeddings, c{args.clients}, {served_dtype} (default) | {rate:.2f} | |")
    print(f"| sentence-transformers, default (checkpoint dtype), batch {default_batch} | {default_rate:.2f} | "
          f"{rate / default_rate:.2f}x |")
    print(f"| sentence-transformers, float32, batch {st_batch} | {st_rate:.2f} | {rate / st_rate:.2f}x |")
    print(f"vectors agree with the fp32 run to cosine >= {cosine.min():.6f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
