"""`Transport` over NATS (nats-py), with the semantics of `InProcessTransport`: in-order delivery per
subscription, one message at a time per handler, a failing handler is logged and delivery goes on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from urllib.parse import urlsplit

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from shared.transport import Handler, Message, Subscription, Transport

log = logging.getLogger(__name__)

# nats-py drops messages past these limits as a "slow consumer"; our relay callback drains its queue
# at once, but a stalled event loop (a long synchronous step) can still let a burst pile up there.
PENDING_MSGS_LIMIT = 1 << 20
PENDING_BYTES_LIMIT = 1 << 30
# Publishes buffered while reconnecting (nats-py raises OutboundBufferLimitError past this).
RECONNECT_BUFFER_BYTES = 64 << 20


class _NatsSubscription(Subscription):
    """nats-py's callback only relays into our own queue and pump task, as `InProcessTransport`
    does: nats-py's `unsubscribe` cancels a handler mid-message and its `drain` deadlocks when
    called from that handler; here unsubscribe finishes what was queued, like in-process."""

    def __init__(self, transport: NatsTransport, subject: str, handler: Handler) -> None:
        self.transport, self.subject, self.handler = transport, subject, handler
        self.inbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self.sub: NatsSubscription | None = None
        self.task = asyncio.get_running_loop().create_task(self._pump())

    async def relay(self, msg: Msg) -> None:
        # Never blocks, so nats-py's own pending queue stays near empty: no slow-consumer drops.
        self.inbox.put_nowait(Message(msg.subject, msg.data, msg.reply or None))

    async def _pump(self) -> None:
        while (msg := await self.inbox.get()) is not None:
            try:
                await self.handler(msg)
            except Exception:  # a failing handler must not stop delivery
                log.exception("handler for %s failed", self.subject)

    async def unsubscribe(self) -> None:
        if self.sub is None:
            return
        sub, self.sub = self.sub, None
        self.transport._subs.discard(self)
        with contextlib.suppress(nats.errors.Error):  # closed or draining: interest is gone anyway
            await sub.unsubscribe()
        self.inbox.put_nowait(None)
        if asyncio.current_task() is not self.task:  # from our own handler: the pump ends after it
            await self.task


class NatsTransport(Transport):
    def __init__(self, nc: Client, name: str) -> None:
        self.nc, self.name = nc, name
        self.reconnects = 0  # times the connection came back after a loss; for health checks
        self._subs: set[_NatsSubscription] = set()
        self._sync_subject = "_SGLBUS_SYNC." + nc.new_inbox().rsplit(".", 1)[-1]  # see _sync

    @property
    def max_payload(self) -> int:  # type: ignore[override]  # what the server announced
        return self.nc.max_payload

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    @classmethod
    async def connect(cls, url: str, name: str, connect_timeout: float = 30.0) -> NatsTransport:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        deadline = time.monotonic() + connect_timeout
        # nats-py on a closed port waits ~2 s and logs a traceback per try: wait for the port first.
        while True:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
                writer.close()
                break
            except (OSError, TimeoutError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NATS at {url} not reachable after {connect_timeout} s") from None
                await asyncio.sleep(0.05)
        nc = Client()
        transport = cls(nc, name)
        try:
            # With max_reconnect_attempts=-1 even the first connect retries forever: bound it.
            await asyncio.wait_for(
                nc.connect(
                    url,
                    name=name,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                    connect_timeout=2,
                    pending_size=RECONNECT_BUFFER_BYTES,
                    drain_timeout=5,
                    error_cb=transport._on_error,
                    disconnected_cb=transport._on_disconnected,
                    reconnected_cb=transport._on_reconnected,
                ),
                max(1.0, deadline - time.monotonic()),
            )
        except TimeoutError:
            await nc.close()
            raise TimeoutError(f"could not connect to NATS at {url}") from None
        return transport

    async def _on_error(self, e: Exception) -> None:
        # The EOF of a lost server is reported by _on_disconnected, and refused connections repeat
        # every reconnect_time_wait while it is down: keep both quiet.
        expected = self.nc.is_reconnecting or isinstance(e, nats.errors.UnexpectedEOF)
        level = logging.DEBUG if expected else logging.WARNING
        log.log(level, "nats %s: %s: %s", self.name, type(e).__name__, e)

    async def _on_disconnected(self) -> None:
        if not self.nc.is_closed:
            log.warning("nats %s: disconnected, reconnecting", self.name)

    async def _on_reconnected(self) -> None:
        self.reconnects += 1
        log.warning("nats %s: reconnected to %s", self.name, getattr(self.nc.connected_url, "netloc", "?"))

    async def _sync(self) -> None:
        """A round trip ordered after everything sent before, so a SUB is live on the server when
        subscribe returns (a publish from another connection right after is delivered, as
        in-process). Not nc.flush(): nats-py writes its PING straight to the socket, ahead of a SUB
        still in the outgoing buffer, and the PONG can come back before the SUB is processed. A
        request to a subject nobody listens on travels in order and the server answers it."""
        with contextlib.suppress(nats.errors.Error):  # "no responders" is the expected answer
            await self.nc.request(self._sync_subject, b"", timeout=5)

    async def publish(self, subject: str, data: bytes, reply: str | None = None) -> None:
        await self.nc.publish(subject, data, reply=reply or "")

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError:
            raise TimeoutError(f"no responders on {subject}") from None
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no reply on {subject} within {timeout} s") from None
        return msg.data

    def new_inbox(self) -> str:
        return self.nc.new_inbox()

    async def subscribe(self, subject: str, handler: Handler, queue: str | None = None) -> Subscription:
        sub = _NatsSubscription(self, subject, handler)
        # nats-py runs one cb task per subscription, message by message: order is kept into our queue.
        try:
            sub.sub = await self.nc.subscribe(
                subject,
                queue=queue or "",
                cb=sub.relay,
                pending_msgs_limit=PENDING_MSGS_LIMIT,
                pending_bytes_limit=PENDING_BYTES_LIMIT,
            )
        except BaseException:
            sub.task.cancel()
            raise
        self._subs.add(sub)
        if self.nc.is_connected:  # while reconnecting, the SUB is resent on reconnect
            await self._sync()
        return sub

    async def close(self) -> None:
        for sub in list(self._subs):  # finish what handlers have queued, as in-process close does
            await sub.unsubscribe()
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()  # flushes buffered publishes, then closes
        except nats.errors.Error:  # reconnecting or already closing: nothing to flush to
            await self.nc.close()
