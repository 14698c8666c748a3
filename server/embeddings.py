"""Serves ``POST /v1/embeddings`` for an embedding model (the engine's pooling runner, engine/pooling.py): each input
is one engine request, batched with every other request in flight as prompts are, and its vector comes back when
its prompt is computed. ``dimensions`` cuts a Matryoshka-trained vector (renormalized where the model normalizes);
``encoding_format: base64`` sends little-endian float32 bytes, as OpenAI's does."""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from engine.sampling_params import SamplingParams
from server.async_engine import Choice
from server.prompts import Prompt
from server.protocol import APIError, _Strict
from server.serving import OpenAIServing

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def _vector(values: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    if dimensions is None or dimensions == len(values):
        return values
    cut = values[:dimensions]
    if not normalize:
        return cut
    norm = math.sqrt(sum(v * v for v in cut)) or 1.0
    return [v / norm for v in cut]


class EmbeddingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: EmbeddingRequest, raw: Request) -> JSONResponse:
        arrival = time.monotonic()
        serving = self.serving
        serving.check_model(body.model)
        spec = serving.engine.info.pooling
        if spec is None:
            raise APIError(400, "this server's model generates text: /v1/embeddings needs an embedding model (a "
                                "sentence-transformers checkpoint, or --runner pooling)", param="model")
        if body.dimensions is not None and body.dimensions != spec.hidden_size:
            try:
                spec.check_dimensions(body.dimensions)
            except ValueError as e:
                raise APIError(400, str(e), param="dimensions") from None
        items = [body.input] if isinstance(body.input, str) or (body.input and isinstance(body.input[0], int)) \
            else body.input
        if not items or len(items) > MAX_INPUTS or any(not item for item in items):
            raise APIError(400, f"input must hold 1 to {MAX_INPUTS} non-empty texts or token id lists",
                           param="input")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(item, await serving.prompts.encode_prompt(item, "input")))
            else:
                prompts.append(Prompt(None, serving.prompts.check_token_ids(list(item), "input")))
        params = SamplingParams(temperature=0, max_tokens=1)
        try:
            serving.validate(prompts, params)
        except APIError as e:
            raise APIError(e.status, str(e), param="input" if e.param == "prompt" else e.param) from None
        request_id = f"embd-{uuid.uuid4().hex}"
        choices = [Choice(f"{request_id}-{i}", p.token_ids, params, i) for i, p in enumerate(prompts)]
        serving.admit(len(choices))
        states = sorted(await serving.collect(choices, raw, arrival), key=lambda s: s.index)
        data = []
        for state in states:
            vector = _vector(state.pooled, body.dimensions, spec.normalize)
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() \
                if body.encoding_format == "base64" else vector
            data.append({"object": "embedding", "index": state.index, "embedding": embedding})
        num_tokens = sum(len(p.token_ids) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": serving.served_model_name,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}},
                            headers={"X-Request-Id": request_id})
