"""The FastAPI application: routes, the OpenAI error envelope, API-key checks and draining on shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.async_engine import AsyncEngine
from server.debug import add_debug_routes
from server.embeddings import EmbeddingRequest, EmbeddingServing
from server.limits import DEFAULT_MAX_BODY_BYTES, MAX_JSON_DEPTH
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
from server.responses import ResponsesServing
from server.responses_protocol import ResponsesRequest
from server.serving import OpenAIServing, ThinkingDefaults

logger = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound=BaseModel)
_PARSE_INLINE_BYTES = 64 << 10  # larger bodies are parsed on a thread, so streams keep flowing meanwhile


async def read_body(raw: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (before the rest is read)."""
    too_large = APIError(413, f"the request body exceeds this server's limit of {limit} bytes "
                              "(--max-request-body-bytes)", code="request_too_large")
    length = raw.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def load_json(body: bytes) -> object:
    """Parse a body, refusing (400) malformed JSON and nesting deeper than MAX_JSON_DEPTH."""
    try:
        data = json.loads(body)
    except RecursionError:  # deeper than the parser goes: find the field in the text
        field = deep_field_in_text(body.decode("utf-8", errors="replace"), MAX_JSON_DEPTH)
        raise APIError(400, f"{field or 'the JSON body'} nests deeper than {MAX_JSON_DEPTH} levels of arrays and "
                            "objects", param=field) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if isinstance(data, dict):
        field = too_deep(data, MAX_JSON_DEPTH)
        if field is not None:
            raise APIError(400, f"{field} nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects",
                           param=field)
    return data


def too_deep(body: dict, limit: int) -> str | None:
    """The top-level field under which ``body`` nests arrays and objects more than ``limit`` deep, if one does."""
    stack = [(value, 2, key) for key, value in body.items() if isinstance(value, (dict, list))]
    while stack:
        value, depth, field = stack.pop()
        if depth > limit:
            return field
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1, field) for c in children if isinstance(c, (dict, list)))
    return None


_JSON_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def deep_field_in_text(text: str, limit: int) -> str | None:
    """``too_deep`` for JSON text too deep to parse: the top-level key whose value opens the level past ``limit``
    (the last string at level 1 before it is that key)."""
    depth, key = 0, None
    for match in _JSON_STRUCTURE.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return key
        elif token in "]}":
            depth -= 1
        elif depth == 1:
            key = json.loads(token)
    return None


async def parse_body(raw: Request, model: type[ModelT], max_body_bytes: int) -> ModelT:
    if "application/json" not in raw.headers.get("content-type", ""):
        raise APIError(400, "Content-Type must be application/json", code="invalid_content_type")
    body = await read_body(raw, max_body_bytes)
    data = load_json(body) if len(body) <= _PARSE_INLINE_BYTES else await asyncio.to_thread(load_json, body)
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


class InternalErrorMiddleware:
    """Any exception a route did not turn into an error response: a 500 with OpenAI's error JSON, and the
    connection stays open for the client's next request. (Starlette's catch-all handler re-raises after
    answering, and uvicorn then closes the connection, failing that next request too.) A response already under
    way (a stream) is ended cleanly; streams put their own error event in first."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                error = APIError(500, f"internal error: {type(e).__name__}: {e}")
                await JSONResponse(error.body(), status_code=500)(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_waiting_requests: int = 1024, tool_call_parser: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, enable_debug_routes: bool = False,
              reasoning_parser: str | None = None, thinking: ThinkingDefaults | None = None,
              sampling_defaults: dict | None = None) -> FastAPI:
    app = FastAPI(title="Harpoon", description="OpenAI-compatible LLM server", docs_url=None, redoc_url=None)
    app.add_middleware(InternalErrorMiddleware)
    serving = OpenAIServing(engine, engine.tokenizer, served_model_name, max_waiting_requests, tool_call_parser,
                            reasoning_parser, thinking, sampling_defaults)
    responses = ResponsesServing(serving)
    embeddings = EmbeddingServing(serving)
    app.state.engine = engine
    app.state.draining = False
    created = int(time.time())

    # NOTE: the dependencies are coroutines, though they never wait: FastAPI runs a plain function's dependency on
    # its thread pool, a hop to another thread and back for every request (in bursts of 256 requests, the event
    # loop's thread took 1.38 ms a request with the hop and 1.13 without, loadtest/lab/front_end.py).
    async def check_key(raw: Request) -> None:
        if api_key is not None and raw.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def guard(raw: Request) -> None:
        await check_key(raw)
        if app.state.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _api_error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"route {raw.method} {raw.url.path} not found" if e.status_code == 404 else str(e.detail)
        return _api_error_response(APIError(e.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _api_error_response(APIError(400, str(e.errors()[0].get("msg", e))))

    @app.get("/health")
    async def health() -> Response:
        problem = engine.health_problem()
        if problem is not None:
            return _api_error_response(APIError(503, problem))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(guard)])
    async def models() -> JSONResponse:
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "harpoon",
                "root": engine.info.model_path, "max_model_len": engine.info.limits.max_model_len,
                "sampling_defaults": serving.sampling_defaults}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions", dependencies=[Depends(guard)])
    async def completions(raw: Request) -> Response:
        return await serving.completions(await parse_body(raw, CompletionRequest, max_body_bytes), raw)

    @app.post("/v1/chat/completions", dependencies=[Depends(guard)])
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(await parse_body(raw, ChatCompletionRequest, max_body_bytes), raw)

    @app.post("/v1/responses", dependencies=[Depends(guard)])
    async def create_response(raw: Request) -> Response:
        return await responses.create(await parse_body(raw, ResponsesRequest, max_body_bytes), raw)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(guard)])
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    @app.post("/v1/embeddings", dependencies=[Depends(guard)])
    async def create_embeddings(raw: Request) -> Response:
        return await embeddings.create(await parse_body(raw, EmbeddingRequest, max_body_bytes), raw)

    @app.post("/tokenize", dependencies=[Depends(guard)])
    async def tokenize(raw: Request) -> JSONResponse:
        body = await parse_body(raw, TokenizeRequest, max_body_bytes)
        serving.check_model(body.model)
        if body.messages is not None:
            tokens = (await serving.prompts.chat_prompt(body.messages)).token_ids
        else:
            tokens = await serving.prompts.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": engine.info.limits.max_model_len})

    @app.post("/detokenize", dependencies=[Depends(guard)])
    async def detokenize(raw: Request) -> JSONResponse:
        body = await parse_body(raw, DetokenizeRequest, max_body_bytes)
        serving.check_model(body.model)
        vocab = engine.info.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    if enable_debug_routes:
        add_debug_routes(app, engine, check_key)
    return app


def _api_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
