"""The debug routes (``--enable-debug-routes``): one request's timeline, the latest requests, the KV pool, the memory
ledger and the load of the last minutes, as the engine sees them, and the dashboard page that draws them.

Off by default, and behind the API key when one is set: a timeline shows prompt sizes and timing of other users'
requests. The dashboard's page itself holds no data (it asks for the key, then reads the routes with it), so it is
served without one. Every answer comes from the engine between two steps (``AsyncEngine.debug``), so it is consistent.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from engine.memory_ledger import process_memory
from server.async_engine import AsyncEngine, EngineDeadError
from server.protocol import APIError
from server.stats_history import StatsHistory

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"


def add_debug_routes(app: FastAPI, engine: AsyncEngine, check_key: Callable[[Request], Awaitable[None]]) -> None:
    engine.history = StatsHistory()
    page = DASHBOARD.read_text()

    async def ask(what: str, request_id: str | None = None) -> object:
        try:
            return await engine.debug(what, request_id)
        except EngineDeadError as e:
            raise e.api_error() from None
        except TimeoutError:
            raise APIError(503, "the engine did not answer within 10 s") from None

    @app.get("/debug/requests", dependencies=[Depends(check_key)])
    async def recent_requests() -> JSONResponse:
        """Summaries of the running requests and the latest finished ones, newest first."""
        return JSONResponse({"requests": await ask("recent") or []})

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
        return JSONResponse({"engine": await ask("memory"), "api_process": process_memory()})

    @app.get("/debug/stats", dependencies=[Depends(check_key)])
    async def stats() -> JSONResponse:
        """The engine now, and one sample a second over the last minutes (``StatsHistory``)."""
        engine.history.observe(time.monotonic(), engine.stats, engine.num_generated_tokens)
        info, s = engine.info, engine.stats
        return JSONResponse({
            "model": engine.metrics.model_name, "device": info.device, "dtype": info.dtype, "backend": info.backend,
            "kernel_plan": list(info.kernel_plan),
            "now": time.monotonic(), "running": s.num_running, "waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage, "generated_tokens": engine.num_generated_tokens,
            "history": engine.history.as_json(),
        })

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)
