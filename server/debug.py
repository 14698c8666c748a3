"""The debug routes (``--enable-debug-routes``): one request's timeline, the KV pool and the memory ledger, as the
engine sees them.

Off by default, and behind the API key when one is set: a timeline shows prompt sizes and timing of other users'
requests. Every answer comes from the engine between two steps (``AsyncEngine.debug``), so it is consistent.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from engine.memory_ledger import environment_rss
from server.async_engine import AsyncEngine, EngineDeadError
from server.protocol import APIError


def add_debug_routes(app: FastAPI, engine: AsyncEngine, check_key: Callable[[Request], None]) -> None:
    async def ask(what: str, request_id: str | None = None) -> object:
        try:
            return await engine.debug(what, request_id)
        except EngineDeadError as e:
            raise e.api_error() from None
        except TimeoutError:
            raise APIError(503, "the engine did not answer within 10 s") from None

    @app.get("/debug/requests/{request_id}", dependencies=[Depends(check_key)])
    async def request_timeline(request_id: str) -> JSONResponse:
        """The timelines of a request (one per sample for ``n`` > 1), from arrival to its finish."""
        timelines = await ask("requests", request_id)
        if not timelines:
            raise APIError(404, f"no timeline kept for request {request_id!r} (only the last "
                                f"{engine.info.request_timelines} finished requests are kept)", param="request_id")
        return JSONResponse({"request_id": request_id, "samples": timelines})

    @app.get("/debug/kv", dependencies=[Depends(check_key)])
    async def kv_pool() -> JSONResponse:
        """Blocks free, used and cached, each running request's table, and the pool's block map."""
        return JSONResponse(await ask("kv"))

    @app.get("/debug/memory", dependencies=[Depends(check_key)])
    async def memory() -> JSONResponse:
        """The engine process's memory ledger (``engine/memory_ledger.py``) measured now, and this process's RSS."""
        return JSONResponse({"engine": await ask("memory"), "api_process": environment_rss()})
