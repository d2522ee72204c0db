"""/admin/memory: the memory `lever serve` may hold, read and moved while it serves (issue 50).

Beside lever.serve.server's routes, for what manages the device (a phone's app shell that hears
the OS ask for memory, a home box's supervisor): GET gives the budget and what is held; POST
{"limit_bytes": N} makes N the whole server's budget from now on (lever.api.LLM.set_memory, the
server's own parts kept: requests and the live page; the kept conversations shrink once the run
is at its floor: `split`). Generations go on while it moves; below the floor the answer is 409
naming the limit and the floor, and the running generations stop with that line. Behind the
server's API keys: a server started without one has no admin (403), since its routes answer any
local process or, through the guard's checks, page.
"""

from __future__ import annotations

import json

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lever.errors import LeverError
from lever.serve.dialect import openai_error

BODY_BYTES = 4096  # {"limit_bytes": N} and room for whitespace; a larger body is refused unread


def routes(server, *, keyed: bool) -> list[Route]:
    async def memory(request: Request) -> Response:
        if not keyed:
            return _error("/admin/memory needs a server with API keys: start it with --api-key", 403, "forbidden")
        if request.method == "POST":
            limit, refusal = await _limit(request)
            if refusal is not None:
                return refusal
            try:
                await anyio.to_thread.run_sync(server.llm.set_memory, keep_conversations(server, limit))
            except LeverError as e:
                return _error(str(e), 409, "invalid_request_error", "limit_bytes")
        return JSONResponse(state(server))

    return [Route("/admin/memory", memory, methods=["GET", "POST"])]


def reserved_bytes(server) -> int:
    """What the server holds beside its run's plan now (Server.memory_plan's other parts)."""
    return sum(v for k, v in server.memory_plan().items() if k != "run")


def split(server, limit: int) -> tuple[int, int]:
    """A whole server's limit as (the run's budget, the kept conversations' bytes): its requests
    and live page first, then the run down to its floor (every layer streamed), the kept
    conversations what that leaves, up to their planned bytes. A falling cap empties them before
    the run must stop (a dropped conversation costs one prefill later; a run below its floor, every
    request); the run's layers are what it drops first, by its own plan, above that."""
    parts, engine = server.memory_plan(), server.llm.engine
    fixed = parts["requests"] + parts["live page"]
    floor = engine.plan.live_bounds(engine.process_bytes)[0]
    cache = server.sessions[0].cache
    kept = max(0, min(cache.planned_bytes if cache is not None else 0, limit - fixed - floor))
    return limit - fixed - kept, kept


def run_part(server, limit: int) -> int:
    """The run's budget within a whole server's `limit` (split; MemoryWatch.run_part)."""
    return split(server, limit)[0]


def keep_conversations(server, limit: int) -> int:
    """The kept conversations resized to their part of a whole server's `limit` (split;
    MemoryWatch.on_limit, and a POST here); the run's part returned."""
    run, kept = split(server, limit)
    if (cache := server.sessions[0].cache) is not None:
        cache.resize(kept)
    return run


def state(server) -> dict:
    engine = server.llm.engine
    plan, resident = engine.plan, engine.target.resident
    watch = server.llm.engine.memory_watch
    run, reserved = plan.memory.limit_bytes, reserved_bytes(server)
    floor, whole = plan.live_bounds(engine.process_bytes)
    parts, cache = server.memory_plan(), server.sessions[0].cache
    fixed, kept = parts["requests"] + parts["live page"], cache.planned_bytes if cache is not None else 0
    # the least the server runs in (every layer streamed, no conversation kept), the least that holds all
    return {"limit_bytes": run + reserved if run is not None else None, "run_limit_bytes": run,
            "reserved_bytes": reserved, "kept_conversations_bytes": parts["kept conversations"],
            "floor_bytes": floor + fixed, "whole_bytes": whole + fixed + kept,
            "resident_layers": len(resident), "n_layer": plan.spec.n_layer, "resident_bytes": resident.nbytes,
            "late_reads": resident.late_reads, "grown": resident.grown,
            "stopped": str(resident.stopped) if resident.stopped is not None else None,
            "follows_cgroup": watch is not None and watch.cgroup is not None}


async def _limit(request: Request) -> tuple[int, Response | None]:
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > BODY_BYTES:
            return 0, _error(f"the body is over {BODY_BYTES} bytes", 413, "invalid_request_error")
    try:
        limit = json.loads(body).get("limit_bytes")
    except (ValueError, AttributeError):
        return 0, _error('the body must be a JSON object {"limit_bytes": N}', 400, "invalid_request_error")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit < 1 << 50:
        return 0, _error(f"limit_bytes: {str(limit)[:40]!r} is not a whole number of bytes from 1 to 2^50", 400,
                         "invalid_request_error", "limit_bytes")
    return limit, None


def _error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(openai_error(message, kind, param), status_code=status)
