"""The HTTP API (Starlette): SGLang's `/generate` (JSON and SSE) and ops endpoints, over `Gateway`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import sglbus
from services.gateway import sglang_shape
from services.gateway.body_parser import BodyParser
from services.gateway.generate_input import GenerateInput, parse_generate_input
from services.gateway.http_auth import AuthGate, caller_of
from services.gateway.http_guard import RequestGuard
from services.gateway.http_util import (
    BodyBudget,
    BodyTooLarge,
    SingleFlight,
    json_response,
    read_json,
    wait_or_disconnect,
)
from services.gateway.metrics import metrics_route
from services.gateway.openai_api import openai_error, openai_routes
from services.gateway.openai_errors import OpenAIError
from services.gateway.service import Gateway
from shared.finish import Abort
from shared.transport import BusUnavailable

log = logging.getLogger(__name__)

HEALTH_PROBE_TTL_S = 1.0  # /health_generate answers from its last probe this long


def error(message: str, status: int = 400) -> Response:
    return json_response(
        {"error": {"message": message, "code": status}, "object": "error", "message": message}, status
    )


async def read_request(request: Request, limit: int, bodies: BodyParser, budget: BodyBudget) -> GenerateInput:
    """The body as a GenerateInput (ValueError when it is not a valid one)."""
    _, parsed = await bodies.parse(await read_json(request, limit, parse=False, budget=budget))
    if isinstance(parsed, ValueError):
        raise parsed
    return parsed


def build_app(gw: Gateway) -> Starlette:
    limit = gw.cfg.max_body_bytes
    budget = BodyBudget(gw.cfg.max_buffered_bytes)

    async def generate(request: Request) -> Response:
        try:
            req = await read_request(request, limit, gw.requests.bodies, budget)
            states = await gw.requests.submit(req, caller_of(request.scope).owner)
        except BodyTooLarge as e:
            return error(str(e), e.status)
        except ValueError as e:
            return error(str(e), 400)
        except BusUnavailable as e:  # nothing was accepted: the client may simply retry
            return error(f"the request could not be queued: {e}; retry", getattr(e, "status", 503))
        if req.stream:
            return StreamingResponse(_sse(gw, req, states), media_type="text/event-stream")
        answered, done = await wait_or_disconnect(request, gw.requests.wait(states))
        if not answered:  # nobody to answer
            return Response(status_code=499)
        failed = next((st.failure for st in done if st.failure is not None), None)
        if failed is not None:
            return error(failed.message, failed.status_code or 500)
        return json_response(sglang_shape.results(done, req.is_batch))

    async def health(request: Request) -> Response:
        serving = gw.ready and gw.draining is None  # a gateway shutting down says so: 503
        return Response(status_code=200) if serving else error(gw.why_down(), 503)

    async def probe_generate() -> tuple[str, int]:
        """One 1-token generation: ("", 200), or why not and 503."""
        probe = parse_generate_input(
            {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}
        )
        try:
            states = await gw.requests.submit(probe)
            [st] = await asyncio.wait_for(gw.requests.wait(states), gw.cfg.health_generate_timeout)
        except TimeoutError:
            return "a 1-token generation did not finish in time", 503
        except BusUnavailable as e:
            return f"the probe could not be queued: {e}", 503
        if isinstance(st.finish, Abort):
            return st.finish.message, 503
        return "", 200

    probes = SingleFlight(probe_generate, HEALTH_PROBE_TTL_S)

    async def health_generate(request: Request) -> Response:
        """One probe at a time, its answer shared by the callers that arrive meanwhile or within
        HEALTH_PROBE_TTL_S after it (a flood of probes is one generation a second, not thousands)."""
        if not gw.ready or gw.draining is not None:
            return error(gw.why_down(), 503)
        message, status = await probes()
        return Response(status_code=200) if status == 200 else error(message, status)

    async def model_info(request: Request) -> Response:
        return json_response(gw.model_info())

    async def server_info(request: Request) -> Response:
        try:
            info = await gw.refresh_info()
        except Exception as e:
            return error(f"no scheduler answered: {e}", 503)
        gateway = {"max_body_bytes": limit, "max_bus_request_bytes": gw.cfg.max_bus_request_bytes,
                   "in_flight": gw.requests.in_flight,
                   "uptime_s": round(time.time() - gw.started, 3), "stats": gw.requests.stats}  # fmt: skip
        return json_response({**info, "version": sglbus.__version__, "gateway": gateway})

    async def flush_cache(request: Request) -> Response:
        try:
            ok = (await gw.ctl("flush_cache"))["success"]
        except Exception as e:
            return error(f"no scheduler answered: {e}", 503)
        if not ok:
            return error("cannot flush the cache while requests are running", 400)
        return Response("Cache flushed.\n", status_code=200)

    async def abort_request(request: Request) -> Response:
        try:
            obj = await read_json(request, limit, budget=budget)
        except BodyTooLarge as e:
            return error(str(e), e.status)
        except ValueError as e:
            return error(str(e), 400)
        if not isinstance(obj, dict) or (not obj.get("abort_all") and not isinstance(obj.get("rid"), str)):
            return error('send {"rid": "<request id>"} or {"abort_all": true}', 400)
        caller = caller_of(request.scope)
        owner = None if caller.admin else caller.owner  # the admin key reaches every client's requests
        rid = None if obj.get("abort_all") else obj["rid"]
        await gw.requests.abort_owned(owner, rid)
        return Response(status_code=200)

    async def list_models(request: Request) -> Response:
        """OpenAI's model list (SGLang serves it too; its bench_serving reads the model name here)."""
        card = {
            "id": gw.served_model_name, "object": "model", "created": int(gw.started), "owned_by": "sglbus",
            "root": gw.model_path, "max_model_len": gw.requests.context_len,
        }  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def retrieve_model(request: Request) -> Response:
        """OpenAI's `GET /v1/models/{model}` (`client.models.retrieve`): the card, or its 404."""
        name = request.path_params["model"]
        if name not in gw.openai.models():
            message = f"The model `{name}` does not exist; this server serves {gw.served_model_name!r}"
            return openai_error(OpenAIError(message, "model", 404, code="model_not_found"))
        card = {"id": name, "object": "model", "created": int(gw.started), "owned_by": "sglbus",
                "root": gw.model_path, "max_model_len": gw.requests.context_len}  # fmt: skip
        return json_response(card)

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/metrics", metrics_route(gw), methods=["GET"]),
        *openai_routes(gw, budget),
    ]
    auth = [Middleware(RequestGuard, bound_to=gw.cfg.host, allowed_hosts=gw.cfg.allowed_hosts),
            Middleware(AuthGate, api_key=gw.cfg.api_key, admin_api_key=gw.cfg.admin_api_key)]  # fmt: skip

    async def no_route(request: Request, exc: Exception) -> Response:
        """An unknown path or method: JSON in OpenAI's error shape, as every other error here."""
        status = getattr(exc, "status_code", 404)
        what = "path" if status == 404 else f"method {request.method} for"
        return openai_error(OpenAIError(f"no {what} {request.url.path} on this server", None, status))

    return Starlette(routes=routes, middleware=auth, exception_handlers={404: no_route, 405: no_route})


async def _sse(gw: Gateway, req: GenerateInput, states: list) -> AsyncIterator[bytes]:
    async for event in gw.requests.stream(states):
        failed = sglang_shape.error_body(event.state) if event.finish is not None else None
        chunk = failed if failed is not None else sglang_shape.stream_chunk(event, req.is_batch)
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"
