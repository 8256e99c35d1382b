"""What the HTTP API refuses before any route runs (pure ASGI, so streams pass through untouched):

- a state-changing request (POST) whose body is declared as something other than JSON: 415. A web
  page can make a browser send a form or text/plain POST to any address without asking (no CORS
  preflight), but not an application/json one; a body without a Content-Type (tools, not browsers)
  is read as JSON as before, and so is an empty body declared as another type that is not a form or
  text (aiohttp labels an empty POST application/octet-stream; a browser asks first for that type);
- on a server bound to loopback, a Host header that names another host: 403. A page at evil.example
  whose name resolves to 127.0.0.1 (DNS rebinding) reaches the server with its own name as Host;
  a local client sends localhost or the address.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_LOCAL_NAMES = (b"127.0.0.1", b"localhost", b"[::1]", b"::1")


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


# what a page may make a browser POST anywhere without a CORS preflight (the Fetch standard's list)
_SIMPLE_TYPES = (b"application/x-www-form-urlencoded", b"multipart/form-data", b"text/plain")


def _refused_type(content_type: bytes, length: bytes | None) -> bool:
    if _is_json(content_type):
        return False
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind in _SIMPLE_TYPES or length != b"0"


def _name(host: bytes) -> bytes:
    """A Host header's name, without its port."""
    return (host.rsplit(b":", 1)[0] if host.count(b":") == 1 or host.startswith(b"[") else host).lower()


class RequestGuard:
    def __init__(self, app: ASGIApp, bound_to: str, allowed_hosts: str | None = None) -> None:
        """bound_to: the address the server listens on (the Host check applies on loopback only);
        allowed_hosts: more names it answers there, comma-separated ("*": any)."""
        extra = [h.strip().lower().encode() for h in (allowed_hosts or "").split(",") if h.strip()]
        self.app, self.loopback = app, bound_to in LOOPBACK_HOSTS and b"*" not in extra
        self.names = frozenset((*_LOCAL_NAMES, *extra))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"")
            if self.loopback and host and _name(host) not in self.names:
                why = f"Host {host.decode('latin-1')!r} is not this server: on a loopback address it answers "
                return await _refuse(send, 403, why + "localhost, 127.0.0.1, [::1] and --allowed-hosts only")
            content_type = headers.get(b"content-type")
            length = headers.get(b"content-length")
            if scope["method"] == "POST" and content_type is not None and _refused_type(content_type, length):
                what = content_type.decode("latin-1")
                return await _refuse(send, 415, f"{scope['path']} takes a JSON body: send Content-Type: "
                                     f"application/json, not {what!r}")  # fmt: skip
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, message: str) -> None:
    body = orjson.dumps(
        {"error": {"message": message, "code": status}, "object": "error", "message": message}
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
