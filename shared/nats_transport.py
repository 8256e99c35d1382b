"""`Transport` over NATS (nats-py), with the semantics of `InProcessTransport`: in-order delivery per
subscription, one message at a time per handler, a failing handler is logged and delivery goes on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from shared.nats_claims import NatsClaims
from shared.transport import (
    ACK,
    NAK,
    PROGRESS,
    TERM,
    BusUnavailable,
    Handler,
    Message,
    Subscription,
    Transport,
    Work,
    work_lane,
)  # fmt: skip

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BusAuth:
    """How a service proves itself to NATS (a token, a user and password, or a credentials file), and
    how it knows the server: `tls_ca`, the CA file its TLS certificate must chain to."""

    token: str | None = None
    user: str | None = None
    password: str | None = None
    creds: str | None = None  # path of a NATS .creds file (JWT + nkey seed)
    tls_ca: str | None = None

    def connect_options(self) -> dict[str, Any]:  # without tls_ca, nats-py checks TLS with the system's CAs
        opts: dict[str, Any] = {"token": self.token, "user": self.user, "password": self.password,
                                "user_credentials": self.creds}  # fmt: skip
        if self.tls_ca:
            try:
                opts["tls"] = ssl.create_default_context(cafile=self.tls_ca)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cannot use {self.tls_ca} as the NATS TLS CA file: {e}") from None
        return {k: v for k, v in opts.items() if v}


# nats-py drops messages past these limits as a "slow consumer"; our relay callback drains its queue
# at once, but a stalled event loop (a long synchronous step) can still let a burst pile up there.
PENDING_MSGS_LIMIT = 1 << 20
PENDING_BYTES_LIMIT = 1 << 30
# Publishes buffered while reconnecting (nats-py raises OutboundBufferLimitError past this).
RECONNECT_BUFFER_BYTES = 64 << 20
# Work queues: how long publish_work waits for JetStream to store a message (covers a NATS restart),
# and how long an undelivered message may wait for a worker before JetStream drops it.
WORK_PUBLISH_TIMEOUT_S = 10.0
WORK_MAX_AGE_S = 3600.0
# the work-queue stream's bounds: past them a publish is refused at once (the gateway answers 503), never
# a NATS that fills its disk or memory (requests are taken off the queue as schedulers accept them)
WORK_MAX_MSGS = 1_000_000
WORK_MAX_BYTES = 1 << 30
# how long a service waits at start for JetStream (a cluster elects its leader within seconds)
JETSTREAM_PATIENCE_S = 30.0
WORK_RETRY_S = 0.25  # between tries of a publish that JetStream refused for the moment
_VERDICT_BYTES = {ACK: b"+ACK", PROGRESS: b"+WPI", NAK: b"-NAK", TERM: b"+TERM"}


def work_stream_name(subject: str) -> str:
    """The JetStream stream behind a work-queue subject: `sglbus.req` -> `SGLBUS_REQ`."""
    return "".join(c if c.isalnum() else "_" for c in subject).upper()


class _NatsSubscription(Subscription):
    """nats-py's callback only relays into our own queue and pump task, as `InProcessTransport`
    does: nats-py's `unsubscribe` cancels a handler mid-message and its `drain` deadlocks when
    called from that handler; here unsubscribe finishes what was queued, like in-process."""

    def __init__(self, transport: NatsTransport, subject: str, handler: Handler, work: bool = False) -> None:
        self.transport, self.subject, self.handler, self.work = transport, subject, handler, work
        self.inbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self.sub: NatsSubscription | None = None
        self.task = asyncio.get_running_loop().create_task(self._pump())

    async def relay(self, msg: Msg) -> None:
        # Never blocks, so nats-py's own pending queue stays near empty: no slow-consumer drops.
        if self.work:  # a JetStream push delivery: its reply subject is the ack token
            try:
                deliveries = msg.metadata.num_delivered
            except Exception:  # not a JetStream delivery (someone published to the deliver subject)
                log.warning("dropping a message on %s that JetStream did not deliver", msg.subject)
                return
            self.inbox.put_nowait(Message(self.subject, msg.data, None, Work(msg.reply, deliveries)))
        else:
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
    def __init__(self, nc: Client, name: str, stream_replicas: int = 1) -> None:
        self.nc, self.name = nc, name
        self.stream_replicas = stream_replicas  # NATS nodes that keep each work-queue message
        self.reconnects = 0  # times the connection came back after a loss; for health checks
        self._subs: set[_NatsSubscription] = set()
        self.js = nc.jetstream()
        self._claims = NatsClaims(self.js, stream_replicas)
        self._streams: set[str] = set()  # work-queue subjects whose stream this connection ensured
        # (work subject, lane key) -> (group, ack_wait): the consumers to restore after a reconnect
        self._consumers: dict[tuple[str, str | None], tuple[str, float]] = {}
        self._refused: asyncio.Future[None] | None = None  # set when the first connect is refused
        self._sync_subject = "_SGLBUS_SYNC." + nc.new_inbox().rsplit(".", 1)[-1]  # see _sync
        self._connected_at = time.monotonic()
        self.work_max_msgs, self.work_max_bytes = WORK_MAX_MSGS, WORK_MAX_BYTES

    @property
    def max_payload(self) -> int:  # type: ignore[override]  # what the server announced
        return self.nc.max_payload

    @property
    def is_connected(self) -> bool:  # type: ignore[override]
        return self.nc.is_connected

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        connect_timeout: float = 30.0,
        auth: BusAuth | None = None,
        stream_replicas: int = 1,
    ) -> NatsTransport:
        """`url`: one server, or the nodes of a cluster comma-separated (the connection moves to a live
        one when its node dies). `auth`: credentials for a NATS that requires them (a token,
        user/password or a .creds file, and its `tls_ca`); a token or user:password in a URL works too.
        `stream_replicas`: how many nodes keep each work-queue message (3 in a cluster of 3 or more: one
        may die). PermissionError when NATS refuses the credentials or its TLS certificate."""
        servers = _server_urls(url)
        if auth is None or not (auth.token or auth.user or auth.creds):
            # as options, so nodes the cluster announces get them too
            auth = replace(_url_auth(servers) or BusAuth(), tls_ca=auth.tls_ca if auth else None)
        options = auth.connect_options()  # a CA file that does not load: ValueError before any wait
        deadline = time.monotonic() + connect_timeout
        # nats-py on a closed port waits ~2 s and logs a traceback per try: wait for a port first.
        while not await _any_port_open(servers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"NATS at {redact_url(url)} not reachable after {connect_timeout} s")
            await asyncio.sleep(0.05)
        nc = Client()
        transport = cls(nc, name, stream_replicas)
        transport.where = ",".join(redact_url(s) for s in servers)
        transport._refused = asyncio.get_running_loop().create_future()
        try:
            # With max_reconnect_attempts=-1 even the first connect retries forever: bound it, and
            # stop at once when the server refuses our credentials (retrying cannot help).
            connecting = nc.connect(
                servers,
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
                **options,
            )
            await _first(connecting, transport._refused, max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            await nc.close()
            raise TimeoutError(f"could not connect to NATS at {redact_url(url)}") from None
        except nats.errors.AuthorizationError:
            await nc.close()
            raise PermissionError(
                f"NATS at {redact_url(url)} refused the credentials (token, user or creds)"
            ) from None
        except ssl.SSLError as e:
            await nc.close()
            raise PermissionError(f"NATS at {redact_url(url)}: TLS failed ({e.reason or e}); a server with "
                                  "its own CA needs it given (--nats-tls-ca)") from None  # fmt: skip
        transport._connected_at = time.monotonic()
        return transport

    async def check_jetstream(self, url: str, patience: float = JETSTREAM_PATIENCE_S) -> None:
        """Raise LookupError (no JetStream at all: nobody answers its API) or TimeoutError (JetStream
        there but not ready within `patience`: a cluster still electing its leader) unless this
        NATS has JetStream, which keeps the work queue."""
        deadline = time.monotonic() + patience
        while True:
            try:
                await self.js.account_info()
                return
            except nats.js.errors.ServiceUnavailableError as e:
                absent = e.description is None  # no responders: not a JetStream that is still starting
                if time.monotonic() > (min(deadline, self._connected_at + 3.0) if absent else deadline):
                    if absent:
                        raise LookupError(
                            f"the NATS server at {url} has no JetStream (sglbus keeps its work queue there): "
                            "start it with `nats-server -js` (or `jetstream {}` in its config)"
                        ) from None
                    raise TimeoutError(f"JetStream at {url} not ready after {patience:.0f} s: {e}") from None
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"JetStream at {url} did not answer within {patience:.0f} s") from None
            await asyncio.sleep(0.25)

    async def _on_error(self, e: Exception) -> None:
        refused = isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in str(e).lower()
        # a certificate that does not check out now will not later either: stop, as for bad credentials
        first = self._refused is not None and not self._refused.done()  # the first connect still waits
        if first and (refused or isinstance(e, ssl.SSLError)):
            self._refused.set_exception(nats.errors.AuthorizationError() if refused else e)
            return
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
        url = self.nc.connected_url
        where = f"{url.hostname}:{url.port}" if url is not None else "?"  # never the token in the netloc
        log.warning("nats %s: reconnected to %s", self.name, where)
        # a NATS that came back without its store has lost the work-queue streams: make them again
        self._streams.clear()
        if self._consumers:
            asyncio.get_running_loop().create_task(self._ensure_consumers())

    # -- work queues (JetStream) ----------------------------------------------------------------
    async def _ensure_stream(self, subject: str) -> str:
        name = work_stream_name(subject)
        if subject in self._streams:
            return name
        # one stream for the shared lane and every keyed lane (`<subject>.<key>`)
        cfg = StreamConfig(
            name=name, subjects=[subject, work_lane(subject, "*")], retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE, discard=DiscardPolicy.NEW, max_age=WORK_MAX_AGE_S,
            max_msgs=self.work_max_msgs, max_bytes=self.work_max_bytes, num_replicas=self.stream_replicas,
        )  # fmt: skip
        try:
            await self.js.add_stream(cfg)
        except nats.js.errors.BadRequestError:  # exists with another configuration: take ours
            await self.js.update_stream(cfg)
        self._streams.add(subject)
        return name

    async def _ensure_consumer(self, subject: str, group: str, ack_wait: float, key: str | None) -> None:
        stream = await self._ensure_stream(subject)
        lane, durable = work_lane(subject, key), _durable(group, key)
        cfg = ConsumerConfig(
            durable_name=durable, deliver_subject=_deliver_subject(lane), deliver_group=durable,
            filter_subject=lane, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait, max_deliver=-1,
            max_ack_pending=-1, num_replicas=self.stream_replicas,
        )  # fmt: skip
        try:
            await self.js.add_consumer(stream, cfg)
        except nats.js.errors.BadRequestError:  # exists with another ack_wait or filter: replace it
            await self.js.delete_consumer(stream, durable)
            await self.js.add_consumer(stream, cfg)

    async def _ensure_consumers(self) -> None:
        for (subject, key), (group, ack_wait) in list(self._consumers.items()):
            try:
                await self._ensure_consumer(subject, group, ack_wait, key)
            except Exception as e:  # the next reconnect tries again
                log.warning("nats %s: could not restore the work queue %s: %s", self.name,
                            work_lane(subject, key), e)  # fmt: skip

    async def publish_work(self, subject: str, data: bytes, key: str | None = None) -> int:
        """Stored, or BusUnavailable once WORK_PUBLISH_TIMEOUT_S passed. Refusals that end by
        themselves are tried again every WORK_RETRY_S: no responder for the stream (a cluster electing
        its leader after a node died, a NATS restarting without its store: the stream is made again)
        and JetStream's 503. Each try carries the same `Nats-Msg-Id`, so a try that was stored though
        its answer was lost is not stored twice (JetStream's duplicate window)."""
        deadline = time.monotonic() + WORK_PUBLISH_TIMEOUT_S
        headers = {"Nats-Msg-Id": uuid.uuid4().hex}
        while True:
            try:
                await self._ensure_stream(subject)
                left = max(0.5, deadline - time.monotonic())
                ack = await self.js.publish(work_lane(subject, key), data, timeout=left, headers=headers)
                return ack.seq
            except (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError) as e:
                full = getattr(e, "description", None) or ""
                if "maximum" in full:  # the stream is at its bounds: no retry will fit it
                    raise BusUnavailable(f"the work queue is full ({full}); retry shortly") from None
                self._streams.discard(subject)  # gone, or its leader is: ensure it again on the next try
                why = f"no work queue for {subject} on NATS ({type(e).__name__})"
            except nats.js.errors.APIError as e:
                if e.code != 503:
                    raise BusUnavailable(f"NATS did not store the message ({e})") from None
                self._streams.discard(subject)
                why = f"NATS did not store the message ({e})"
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as e:
                raise BusUnavailable(f"NATS did not store the message ({type(e).__name__})") from None
            if time.monotonic() + WORK_RETRY_S > deadline:
                raise BusUnavailable(why)
            await asyncio.sleep(WORK_RETRY_S)

    async def withdraw_work(self, subject: str, receipt: int) -> bool:
        if not receipt:
            return False
        try:
            return bool(await self.js.delete_msg(work_stream_name(subject), receipt))
        except nats.js.errors.NotFoundError:  # acknowledged (or expired) already
            return False
        except nats.js.errors.APIError as e:  # JetStream says "no message found" as a plain API error
            if e.code == 404 or "no message found" in str(e).lower():
                return False
            raise BusUnavailable(f"NATS did not withdraw the message ({e})") from None
        except (nats.errors.Error, TimeoutError) as e:
            raise BusUnavailable(f"NATS did not withdraw the message ({type(e).__name__})") from None

    async def subscribe_work(
        self, subject: str, group: str, handler: Handler, ack_wait: float, key: str | None = None
    ) -> Subscription:
        await self._ensure_consumer(subject, group, ack_wait, key)
        self._consumers[(subject, key)] = (group, ack_wait)
        lane, durable = work_lane(subject, key), _durable(group, key)
        return await self._subscribe(_deliver_subject(lane), handler, durable, work=True, name=subject)

    async def settle_work(self, token: str, verdict: str) -> None:
        if token:
            await self.nc.publish(token, _VERDICT_BYTES[verdict])

    async def claim(self, bucket: str, key: str, value: str) -> str:
        return await self._claims.claim(bucket, key, value)

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
        return await self._subscribe(subject, handler, queue)

    async def _subscribe(
        self, subject: str, handler: Handler, queue: str | None, work: bool = False, name: str | None = None
    ) -> Subscription:
        sub = _NatsSubscription(self, name or subject, handler, work)
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
        self._consumers.clear()
        for sub in list(self._subs):  # finish what handlers have queued, as in-process close does
            await sub.unsubscribe()
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()  # flushes buffered publishes, then closes
        except nats.errors.Error:  # reconnecting or already closing: nothing to flush to
            await self.nc.close()


async def _first(connecting: Any, refused: asyncio.Future, timeout: float) -> None:
    """Wait for the connect coroutine, unless the refusal future fails first (or time runs out)."""
    task = asyncio.ensure_future(connecting)
    done, _ = await asyncio.wait({task, refused}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
        return
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if refused in done:
        refused.result()  # raises the AuthorizationError
    raise TimeoutError


def redact_url(url: str) -> str:
    """`url` (one server or comma-separated nodes) with any token or user:password replaced by `***`:
    what a message or a log may show."""
    return ",".join(re.sub(r"//[^/@]*@", "//***@", part) for part in url.split(","))


def _server_urls(url: str) -> list[str]:
    """`host:port,nats://host:port,...` -> one nats:// URL per server."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no NATS server in {url!r}")
    return [u if "://" in u else f"nats://{u}" for u in urls]


def _url_auth(servers: list[str]) -> BusAuth | None:
    """The token (`nats://token@host`) or user and password a URL carries; nats-py would send them
    only to the servers listed with them, not to the other nodes of a cluster."""
    for parts in map(urlsplit, servers):
        if parts.username:
            if parts.password is None:
                return BusAuth(token=parts.username)
            return BusAuth(user=parts.username, password=parts.password)
    return None


async def _any_port_open(servers: list[str]) -> bool:
    """Whether any of the servers accepts a TCP connection (a cluster with a node down still does)."""
    for parts in map(urlsplit, servers):
        try:
            conn = asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or 4222)
            _, writer = await asyncio.wait_for(conn, 1.0)
        except (OSError, TimeoutError):
            continue
        writer.close()
        return True
    return False


def _durable(group: str, key: str | None) -> str:
    """The JetStream consumer of a lane: the group's name, `<group>_<key>` for a keyed lane."""
    return group if key is None else f"{group}_{work_stream_name(key)}"


def _deliver_subject(subject: str) -> str:
    # outside the stream's own subject, or JetStream would store its deliveries again
    return f"_SGLBUS_WORK.{work_stream_name(subject)}"
