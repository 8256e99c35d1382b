"""What every HTTP endpoint of the gateway needs: JSON responses, a body read within its size limit,
and a wait for a result that stops (and aborts the request) when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from services.gateway.generate_input import decode_json

T = TypeVar("T")

# a 503 says when to try again (overloaded, shutting down, the bus away for a moment)
RETRY_AFTER_S = 1


def json_response(obj: Any, status: int = 200) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


class BodyTooLarge(ValueError):
    """A body over the gateway's `max_body_bytes`: HTTP 413 (Payload Too Large), not the 400 of a
    body that is wrong; the message names the limit."""

    status = 413


class BodyTooSlow(BodyTooLarge):
    """A body still arriving BODY_TIMEOUT_S after its request began: 408 (a client trickling bytes
    holds a connection and its buffer for as long as it likes otherwise)."""

    status = 408


class ClientGone(BodyTooLarge):
    """The client closed its connection before its body arrived: nobody to answer (499)."""

    status = 499


class BodiesFull(BodyTooLarge):
    """The gateway holds `max_buffered_bytes` of bodies still arriving: 503, retry (each body is
    bounded by max_body_bytes, but thousands of connections uploading at once would not be)."""

    status = 503


class BodyBudget:
    """The bytes of request bodies a gateway buffers at once, across connections."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise BodiesFull(f"the gateway is receiving {self.held} bytes of request bodies already (its "
                             f"max_buffered_bytes, {self.limit}); retry shortly")  # fmt: skip
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


# the whole body must have arrived this long after the request's headers
BODY_TIMEOUT_S = 60.0


async def read_json(request: Request, limit: int, parse: bool = True, timeout: float = BODY_TIMEOUT_S,
                    budget: BodyBudget | None = None) -> Any:  # fmt: skip
    """The body (decoded JSON, or the bytes with parse=False), refused past `limit` bytes (BodyTooLarge:
    at once when the declared length is over it, else as soon as what arrived is), when it is not
    all there after `timeout` seconds (BodyTooSlow), when `budget` has no room for what arrives
    (BodiesFull) or when the client went away meanwhile (ClientGone)."""
    declared = request.headers.get("content-length")
    where = f"the limit of {limit} bytes (the gateway's max_body_bytes)"
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over {where}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                if budget is not None:
                    budget.take(len(part))
                body += part
                if len(body) > limit:
                    raise BodyTooLarge(f"request body is over {where}")
    except TimeoutError:
        raise BodyTooSlow(
            f"request body not complete after {timeout:.0f} s ({len(body)} bytes came)"
        ) from None
    except ClientDisconnect:
        raise ClientGone(f"the client went away after {len(body)} bytes of its body") from None
    finally:
        if budget is not None:
            budget.give(len(body))
    return decode_json(bytes(body)) if parse else bytes(body)


class SingleFlight:
    """`await flight()` runs `fn` once for every caller that arrives while it runs or within `ttl`
    seconds after it ended; they all get its result."""

    def __init__(self, fn: Callable[[], Awaitable[T]], ttl: float) -> None:
        self.fn, self.ttl = fn, ttl
        self._task: asyncio.Task[T] | None = None
        self._ended = 0.0

    async def __call__(self) -> T:
        task = self._task
        if task is None or (task.done() and time.monotonic() - self._ended > self.ttl):
            task = self._task = asyncio.ensure_future(self._run())
        return await asyncio.shield(task)

    async def _run(self) -> T:
        try:
            return await self.fn()
        finally:
            self._ended = time.monotonic()


async def wait_or_disconnect(request: Request, result: Awaitable[Any]) -> tuple[bool, Any]:
    """(True, the result), or (False, None) once the client has gone away: the wait is cancelled, which
    aborts what is unfinished (RequestManager.wait)."""
    waiter = asyncio.ensure_future(result)
    while not (await asyncio.wait({waiter}, timeout=1.0))[0]:
        if await request.is_disconnected():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            return False, None
    return True, waiter.result()
