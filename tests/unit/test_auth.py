"""The HTTP API key: `Authorization: Bearer <key>` on every route but the health probes; a missing or
wrong key gets a 401 in the API's error shape, and streams pass through the check untouched."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from services.gateway.config import GatewayConfig
from services.gateway.http_app import build_app
from services.gateway.http_auth import AuthGate

KEY = "k3y-for-tests"


def app_with_key() -> Starlette:
    async def ok(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    async def stream(request: Request) -> Response:
        return StreamingResponse(chunks(), media_type="text/event-stream")

    routes = [Route("/health", ok), Route("/health_generate", ok), Route("/generate", ok, methods=["POST"]),
              Route("/stream", stream)]  # fmt: skip
    return Starlette(routes=routes, middleware=[Middleware(AuthGate, api_key=KEY)])


@pytest.fixture
def client() -> TestClient:
    return TestClient(app_with_key(), base_url="http://127.0.0.1")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"X-API-Key": KEY},
    ],  # fmt: skip
)
def test_missing_or_wrong_key_gets_401(client: TestClient, headers: dict[str, str]) -> None:
    r = client.post("/generate", headers=headers, json={})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    body = r.json()
    assert body["error"]["code"] == 401 and "API key" in body["error"]["message"]
    assert body["object"] == "error" and body["message"] == body["error"]["message"]  # error()'s shape


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_right_key_passes(client: TestClient, scheme: str) -> None:
    r = client.post("/generate", headers={"Authorization": f"{scheme} {KEY}"}, json={})
    assert r.status_code == 200 and r.text == "ok"


@pytest.mark.parametrize("path", ["/health", "/health_generate"])
def test_health_probes_stay_open(client: TestClient, path: str) -> None:
    assert client.get(path).status_code == 200


def test_streams_pass_through(client: TestClient) -> None:
    with client.stream("GET", "/stream", headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert list(r.iter_lines()) == ["data: 0", "", "data: 1", "", "data: 2", ""]
    assert client.get("/stream").status_code == 401


def fake_gateway(api_key: str | None) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=GatewayConfig(api_key=api_key), ready=True, draining=None, model_info=lambda: {"model": "m"}
    )


def test_build_app_checks_the_key_when_one_is_configured() -> None:
    http = TestClient(build_app(fake_gateway(KEY)), base_url="http://127.0.0.1")
    assert http.get("/get_model_info").status_code == 401
    assert http.post("/v1/chat/completions", json={}).status_code == 401  # the OpenAI endpoints too
    r = http.get("/get_model_info", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json() == {"model": "m"}
    assert http.get("/health").status_code == 200


def test_build_app_without_a_key_is_open() -> None:
    http = TestClient(build_app(fake_gateway(None)), base_url="http://127.0.0.1")
    assert http.get("/get_model_info").status_code == 200


def test_allowed_hosts_extend_what_a_loopback_server_answers():
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import Response
    from starlette.routing import Route

    from services.gateway.http_guard import RequestGuard

    def app(allowed):
        ok = Route("/x", lambda request: Response("ok"), methods=["GET"])
        return Starlette(
            routes=[ok], middleware=[Middleware(RequestGuard, bound_to="127.0.0.1", allowed_hosts=allowed)]
        )

    proxied = TestClient(app("llm.internal, other.example"), base_url="http://llm.internal:8080")
    assert proxied.get("/x").status_code == 200
    assert TestClient(app("llm.internal"), base_url="http://evil.example").get("/x").status_code == 403
    assert TestClient(app("*"), base_url="http://anything.example").get("/x").status_code == 200
    assert TestClient(app(None), base_url="http://[::1]:30000").get("/x").status_code == 200


ADMIN = "adm1n-for-tests"


def app_with_admin(api_key: str | None) -> Starlette:
    from services.gateway.http_auth import caller_of

    async def who(request: Request) -> Response:
        c = caller_of(request.scope)
        return PlainTextResponse(f"{c.owner} {c.admin}")

    routes = [Route("/flush_cache", who, methods=["GET", "POST"]), Route("/generate", who, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(AuthGate, api_key=api_key, admin_api_key=ADMIN)])


@pytest.mark.parametrize("api_key", [None, KEY])
def test_flush_cache_needs_the_admin_key_when_one_is_set(api_key: str | None) -> None:
    http = TestClient(app_with_admin(api_key), base_url="http://127.0.0.1")
    r = http.post("/flush_cache")
    assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
    r = http.post("/flush_cache", headers={"Authorization": f"Bearer {KEY}"})  # the API key is not it
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    r = http.post("/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.text.endswith(" True")
    # the admin key is accepted where the API key is, and marks its holder
    assert http.post("/generate", headers={"Authorization": f"Bearer {ADMIN}"}).text.endswith(" True")


def test_the_owner_is_the_callers_address_and_token() -> None:
    """Clients with different tokens (or none) own different requests; the same token from the same
    address is the same owner on every connection; the token itself never appears in it."""
    http = TestClient(app_with_admin(None), base_url="http://127.0.0.1")
    owners = [http.post("/generate", headers=h).text.split()[0]
              for h in ({}, {"Authorization": "Bearer a"}, {"Authorization": "Bearer b"},
                        {"Authorization": "Bearer a"})]  # fmt: skip
    assert owners[1] == owners[3] and len({*owners[:3]}) == 3
    assert all(o.startswith("testclient/") for o in owners) and not any(o.endswith("/a") for o in owners)
    assert http.post("/generate", headers={"Authorization": "Bearer a"}).text.endswith(" False")


def test_an_empty_post_labelled_octet_stream_passes_and_forms_do_not() -> None:
    """aiohttp labels an empty POST application/octet-stream (its flush_cache call); a browser must
    ask before it sends that type, so it is no CSRF route. A form or text/plain POST, empty or not,
    and an octet-stream body stay a 415."""
    from services.gateway.http_guard import RequestGuard

    ok = Route("/flush_cache", lambda request: PlainTextResponse("ok"), methods=["POST"])
    http = TestClient(Starlette(routes=[ok], middleware=[Middleware(RequestGuard, bound_to="127.0.0.1")]),
                      base_url="http://127.0.0.1")  # fmt: skip
    assert http.post("/flush_cache", headers={"content-type": "application/octet-stream"}).status_code == 200
    for kind, body in (("text/plain", b""), ("application/x-www-form-urlencoded", b""),
                       ("application/octet-stream", b"{}"), ("text/plain", b"{}")):  # fmt: skip
        assert http.post("/flush_cache", content=body, headers={"content-type": kind}).status_code == 415
