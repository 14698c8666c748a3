"""One streamed request against an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time

import httpx

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


async def send(http: httpx.AsyncClient, endpoint: str, body: dict, bench_start: float,
               timeout: float) -> RequestRecord:
    """POST ``body`` and read its SSE stream; never raises: failures come back as records with ``error``."""
    send_time = time.perf_counter()
    start = send_time - bench_start
    chunk_times: list[float] = []
    text: list[str] = []
    usage: dict = {}
    try:
        async with http.stream("POST", endpoint, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestRecord(start=start, error=f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    return RequestRecord(start=start, error=f"stream error: {data['error'].get('message')}")
                if data.get("usage"):
                    usage = data["usage"]
                if data.get("choices"):
                    chunk_times.append(now)
                    choice = data["choices"][0]
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestRecord(start=start, error=f"{type(e).__name__}: {e}")
    if not usage:
        return RequestRecord(start=start, error="the stream carried no usage (stream_options.include_usage)")
    return record_from_timeline(start, send_time, chunk_times, usage.get("prompt_tokens", 0),
                                usage.get("completion_tokens", 0), "".join(text))
