"""One streamed request against an OpenAI-compatible server, timed chunk by chunk.

NOTE: aiohttp rather than httpx (as ``vllm bench serve`` does): on two cores the load generator takes CPU from the
server it measures, and reading an SSE event through httpx cost 260-350 us of CPU against ~130 us through aiohttp.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import aiohttp

from loadtest.datasets import BenchRequest
from loadtest.metrics import RequestRecord, record_from_timeline


def request_body(endpoint: str, model: str, request: BenchRequest, ignore_eos: bool, temperature: float = 0.0) -> dict:
    body: dict = {"model": model, "max_tokens": request.output_len, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def session(headers: dict | None = None) -> aiohttp.ClientSession:
    """A session without a connection limit (the benchmark's semaphore bounds concurrency) or a default timeout, and a
    connection of its own for each request. NOTE: kept-alive connections that llama-server had closed failed 7 of 32
    requests at 16 streams ("Can not write request body"), and 1 of 32 still with idle ones closed after 3 s; a
    request lasts seconds, its connection's set-up well under a millisecond."""
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, bytes]]:
    """Each ``data:`` payload of an SSE stream up to ``[DONE]``, with the time the bytes that completed it arrived
    (so events read together share a time)."""
    pending = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                payload = line[len(b"data: "):].strip()
                if payload == b"[DONE]":
                    return
                yield now, payload


async def _post(http: aiohttp.ClientSession, url: str, body: dict, timeout: float) -> aiohttp.ClientResponse:
    """The POST's response, sent once more where the connection failed before a response, as the openai SDK
    retries."""
    try:
        return await http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout))
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
        return await http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout))


async def send(http: aiohttp.ClientSession, url: str, body: dict, bench_start: float,
               timeout: float, prompt_len: int | None = None) -> RequestRecord:
    """POST ``body`` and read its SSE stream; never raises: failures come back as records with ``error``. A server
    whose stream carries no ``usage`` (llama-cpp-python's ignores ``stream_options``) is counted as sending a token
    per chunk before the one that finishes, and ``prompt_len`` prompt tokens (our tokenizer's count); without
    ``prompt_len`` such a stream is a failure."""
    send_time = time.perf_counter()
    start = send_time - bench_start
    chunk_times: list[float] = []
    text: list[str] = []
    usage: dict = {}
    token_chunks = 0
    try:
        response = await _post(http, url, body, timeout)
        async with response:
            if response.status != 200:
                detail = (await response.read()).decode(errors="replace")[:300]
                return RequestRecord(start=start, error=f"HTTP {response.status}: {detail}")
            async for now, payload in _events(response):
                event = json.loads(payload)
                if "error" in event:
                    return RequestRecord(start=start, error=f"stream error: {event['error'].get('message')}")
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices"):
                    chunk_times.append(now)
                    choice = event["choices"][0]
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                    token_chunks += choice.get("finish_reason") is None
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return RequestRecord(start=start, error=f"{type(e).__name__}: {e}")
    if not usage and prompt_len is not None:
        usage = {"prompt_tokens": prompt_len, "completion_tokens": token_chunks}
    if not usage:
        return RequestRecord(start=start, error="the stream carried no usage (stream_options.include_usage)")
    return record_from_timeline(start, send_time, chunk_times, usage.get("prompt_tokens", 0),
                                usage.get("completion_tokens", 0), "".join(text))
