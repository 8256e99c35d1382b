"""A real uvicorn on loopback with the gateway's protocol (`http_protocol.header_deadline`): a
connection that sends no request, or trickles its headers (slowloris), is closed after the header
deadline, so it cannot hold one of `limit_concurrency`'s places for ever; a request whose headers
arrived runs as long as it needs, and a keep-alive client goes on."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from services.gateway.http_protocol import header_deadline

DEADLINE_S = 1.0


async def ok(request: Request) -> Response:
    return PlainTextResponse("ok")


async def slow(request: Request) -> Response:
    async def chunks():
        for i in range(4):  # 4 x 0.75 s: longer than the header deadline
            await asyncio.sleep(0.75)
            yield f"{i}\n".encode()

    return StreamingResponse(chunks(), media_type="text/plain")


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    app = Starlette(routes=[Route("/ok", ok), Route("/slow", slow)])
    config = uvicorn.Config(app, host="127.0.0.1", port=free, log_level="warning", lifespan="off",
                            http=header_deadline(DEADLINE_S), limit_concurrency=4)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield free
    server.should_exit = True
    thread.join(timeout=30)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed the connection (recv reads EOF) within `seconds`."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert closed_within(s, 30)


def test_trickled_headers_are_cut_off_and_do_not_starve_other_clients(port: int) -> None:
    """Four trickling connections (as many as limit_concurrency) are closed at the deadline, however
    steadily they send; then a normal client is served again."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        started = time.monotonic()
        line = b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
        for i in range(0, len(line), 8):
            for s in socks:
                try:
                    s.sendall(line[i : i + 8])
                except OSError:
                    pass  # closed already: the deadline passed
            time.sleep(0.05)
            if time.monotonic() - started > 30:
                break
        assert all(closed_within(s, 30) for s in socks)
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"http://127.0.0.1:{port}/ok", timeout=30).text == "ok"


def test_a_response_longer_than_the_deadline_and_keep_alive_go_on(port: int) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        assert http.get("/slow").text == "0\n1\n2\n3\n"  # 3 s of response: its headers came in time
        assert http.get("/ok").text == "ok"  # the same connection, its next request
