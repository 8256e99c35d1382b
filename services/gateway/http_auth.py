"""Who is calling: the API keys, and the owner of the requests a caller sends (pure ASGI, so streams and
disconnect detection pass through untouched).

- `--api-key`: every route but OPEN_PATHS needs `Authorization: Bearer <key>` (401 otherwise).
- `--admin-api-key`: ADMIN_PATHS need it (401 without a key, 403 with another one), and it lets
  `/abort_request` end any client's requests; it is accepted wherever the API key is.
- The owner of a request is the caller's address and a hash of the bearer token it sent (or none):
  a client may abort its own requests by rid, from any connection, and `abort_all` ends only its own;
  rids are the client's labels, so two clients may use the same one. Behind a proxy every client has
  the proxy's address: give each client its own token there (an admin key overrides the scope).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

# open without the API key, as in SGLang: load balancers and orchestrators probe them
OPEN_PATHS = frozenset({"/health", "/health_generate"})
# what one client may not do to the others: with --admin-api-key set, only its holder
ADMIN_PATHS = frozenset({"/flush_cache"})


@dataclass(frozen=True)
class Caller:
    owner: str  # the requests this caller may abort: its address and token
    admin: bool  # holds the admin key: may abort anyone's requests


ANYONE = Caller("", False)  # the offline Engine and the health probe: no HTTP caller


def caller_of(scope: Scope) -> Caller:
    """The caller AuthGate found (a scope that did not pass through it is an anonymous one)."""
    return scope.get("state", {}).get("caller") or ANYONE


def _bearer(scope: Scope) -> bytes | None:
    value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


def _refuse(message: str, status: int) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    error = {"error": {"message": message, "code": status}, "object": "error", "message": message}
    body = orjson.dumps(error)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return status, headers, body


class AuthGate:
    def __init__(self, app: ASGIApp, api_key: str | None = None, admin_api_key: str | None = None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.admin_key = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        admin = (
            token is not None and self.admin_key is not None and hmac.compare_digest(token, self.admin_key)
        )
        refused = self._refusal(scope["path"], token, admin)
        if refused is not None:
            status, headers, body = refused
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        host = (scope.get("client") or ("",))[0] or ""
        mark = hashlib.sha256(token).hexdigest()[:16] if token is not None else "-"
        scope.setdefault("state", {})["caller"] = Caller(f"{host}/{mark}", admin)
        await self.app(scope, receive, send)

    def _refusal(self, path: str, token: bytes | None, admin: bool):
        if path in OPEN_PATHS or admin:
            return None
        if path in ADMIN_PATHS and self.admin_key is not None:
            if token is None:
                return _refuse(f"{path} needs the admin key: send `Authorization: Bearer <admin key>`", 401)
            return _refuse(f"{path} needs the admin key (--admin-api-key); this key is not it", 403)
        if self.key is not None and (token is None or not hmac.compare_digest(token, self.key)):
            return _refuse("missing or wrong API key: send the header `Authorization: Bearer <key>`", 401)
        return None
