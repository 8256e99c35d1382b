"""uvicorn's HTTP protocol (httptools) with a deadline on request headers.

uvicorn closes a connection idle between requests (`timeout_keep_alive`) but puts no deadline on the
headers themselves: a connection that sends nothing, or trickles a header line a byte at a time,
stays open for ever, and `limit_concurrency` counts it, so a few thousand of them (slowloris) make the
server answer every new client with a 503. Here a connection must complete its request's headers
within `header_timeout` seconds of being opened, or of its last response: otherwise it is closed.
Bodies have their own deadline (`http_util.BODY_TIMEOUT_S`, a 408)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 30.0  # nginx's client_header_timeout is 60 s; a real client sends them at once


def header_deadline(seconds: float = HEADER_TIMEOUT_S) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`."""

    class HeaderDeadline(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers (keep-alive closes a silent one sooner)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:  # no request of it is running
                self.transport.close()

    return HeaderDeadline
