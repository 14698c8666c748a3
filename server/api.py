"""The FastAPI application: routes, the OpenAI error envelope, API-key checks and draining on shutdown."""

from __future__ import annotations

import json
import logging
import time
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.async_engine import AsyncEngine
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.serving import OpenAIServing, render_chat

logger = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound=BaseModel)


async def parse_body(raw: Request, model: type[ModelT]) -> ModelT:
    if "application/json" not in raw.headers.get("content-type", ""):
        raise APIError(400, "Content-Type must be application/json", code="invalid_content_type")
    try:
        data = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        param = str(error["loc"][0]) if error["loc"] else None
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            message = f"unsupported parameter: '{where}' is not supported by this server"
        else:
            message = f"{where}: {error['msg']}" if where else error["msg"]
        raise APIError(400, message, param=param) from None


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_waiting_requests: int = 1024, tool_call_parser: str | None = None) -> FastAPI:
    app = FastAPI(title="Harpoon", description="OpenAI-compatible LLM server", docs_url=None, redoc_url=None)
    serving = OpenAIServing(engine, engine.tokenizer, served_model_name, max_waiting_requests, tool_call_parser)
    app.state.engine = engine
    app.state.draining = False
    created = int(time.time())

    def guard(raw: Request) -> None:
        if api_key is not None and raw.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        if app.state.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"route {raw.method} {raw.url.path} not found" if e.status_code == 404 else str(e.detail)
        return _api_error_response(APIError(e.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _api_error_response(APIError(400, str(e.errors()[0].get("msg", e))))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _api_error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))

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
                "root": engine.info.model_path, "max_model_len": engine.info.limits.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions", dependencies=[Depends(guard)])
    async def completions(raw: Request) -> Response:
        return await serving.completions(await parse_body(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions", dependencies=[Depends(guard)])
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(await parse_body(raw, ChatCompletionRequest), raw)

    @app.post("/tokenize", dependencies=[Depends(guard)])
    async def tokenize(raw: Request) -> JSONResponse:
        body = await parse_body(raw, TokenizeRequest)
        serving.check_model(body.model)
        if body.messages is not None:
            tokens = render_chat(serving.tokenizer, body.messages).token_ids
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": engine.info.limits.max_model_len})

    @app.post("/detokenize", dependencies=[Depends(guard)])
    async def detokenize(raw: Request) -> JSONResponse:
        body = await parse_body(raw, DetokenizeRequest)
        serving.check_model(body.model)
        vocab = engine.info.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    return app


def _api_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
