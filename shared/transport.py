"""The bus behind one small interface: publish bytes to a subject, subscribe a handler to a subject,
and a work queue for what must not be lost.

Two implementations: NATS in production (`nats_transport.py`) and `InProcessTransport`, which
`sglbus.Engine` and unit tests use, so offline and served runs share every service's code.
Handlers are coroutines; a subscription delivers its messages in order, one at a time.

Work queue (`publish_work` / `subscribe_work`): a message is stored before `publish_work` returns and
stays until someone settles its delivery (`settle_work(token, ACK)`); a delivery that is neither
acknowledged nor kept alive (`PROGRESS`) within `ack_wait` is delivered again, to any member of the
group. A queue has a shared lane (`key=None`: any member of the group takes each message) and one
lane per key (`<queue>.<key>`: a message for one chosen consumer, such as one scheduler worker). The
receipt `publish_work` returns lets the publisher take a message back while nobody acknowledged it
(`withdraw_work`: its consumer died, and it goes to another). On NATS this is one JetStream
work-queue stream for all lanes; in-process nothing can die on its own, so a delivery is final,
settling it does nothing and nothing can be withdrawn.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

log = logging.getLogger(__name__)


CLAIM_TTL_S = 30.0  # a claim holds this long (Transport.claim)


class Work(NamedTuple):
    """One delivery of a work-queue message: `token` settles it (from any process), `deliveries` counts
    this one (1 the first time; more after a worker died holding it)."""

    token: str
    deliveries: int = 1


class Message(NamedTuple):
    subject: str
    data: bytes
    reply: str | None = None  # where a request/reply caller waits for the answer
    work: Work | None = None  # set for work-queue deliveries


# how a work-queue delivery is settled
ACK = "ack"  # done: remove it from the queue
PROGRESS = "progress"  # still working on it: restart its ack_wait clock
NAK = "nak"  # give it back: deliver it again now
TERM = "term"  # drop it without redelivery (undecodable, aborted)
VERDICTS = (ACK, PROGRESS, NAK, TERM)


class BusUnavailable(ConnectionError):
    """The bus did not take a message it had to store (NATS down or its work queue missing)."""


Handler = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class Subjects:
    """Subject names, under a configurable prefix so several deployments can share one NATS."""

    prefix: str = "sglbus"

    @property
    def req(self) -> str:
        """The schedulers' work queue: the shared lane, or `<req>.<worker>` for one worker."""
        return f"{self.prefix}.req"

    @property
    def route_notes(self) -> str:
        """Gateways tell each other where they routed what (`RouteNote`)."""
        return f"{self.prefix}.route"

    def kv_events(self, worker: str) -> str:
        """A scheduler's prefix-cache events (stored / removed blocks) and load, once per step."""
        return f"{self.prefix}.kv.{worker}"

    @property
    def abort(self) -> str:
        return f"{self.prefix}.abort"

    def detok(self, worker: str) -> str:
        return f"{self.prefix}.detok.{worker}"

    def out(self, gateway: str) -> str:
        return f"{self.prefix}.out.{gateway}"

    @property
    def api_generate(self) -> str:
        return f"{self.prefix}.api.generate"

    @property
    def api_completions(self) -> str:
        return f"{self.prefix}.api.completions"

    @property
    def api_chat_completions(self) -> str:
        return f"{self.prefix}.api.chat_completions"

    def ctl(self, what: str) -> str:
        return f"{self.prefix}.ctl.{what}"

    def ctl_all(self, what: str) -> str:
        """Every scheduler answers (no queue group): the gateway's fan-out to all workers."""
        return f"{self.prefix}.ctl.all.{what}"

    @property
    def claims(self) -> str:
        """The bucket of the gateways' claims (`Transport.claim`): a JetStream key-value bucket."""
        return "".join(c if c.isalnum() else "_" for c in self.prefix.upper()) + "_CLAIMS"


class Subscription(ABC):
    @abstractmethod
    async def unsubscribe(self) -> None: ...


class Transport(ABC):
    # the largest message the bus carries (NATS: the server's max_payload); senders split or refuse
    max_payload: int = 1 << 62
    # publisher and subscribers share this process (and its GIL); over NATS they are other processes
    in_process: bool = False
    where: str = ""  # which bus: NATS's server URLs (credentials left out)

    @property
    def is_connected(self) -> bool:
        """Whether this process reaches the bus right now (NATS: not while reconnecting)."""
        return True

    @abstractmethod
    async def publish(self, subject: str, data: bytes, reply: str | None = None) -> None: ...

    @abstractmethod
    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        """Publish with a private reply subject and return the first answer; TimeoutError if none."""

    @abstractmethod
    def new_inbox(self) -> str:
        """A unique subject for replies."""

    @abstractmethod
    async def subscribe(self, subject: str, handler: Handler, queue: str | None = None) -> Subscription:
        """Deliver messages on `subject` to `handler`. Subscribers sharing a `queue` name split the
        messages between them (each message goes to one of them); others each get every message."""

    @abstractmethod
    async def publish_work(self, subject: str, data: bytes, key: str | None = None) -> int:
        """Store `data` in the work queue `subject`, in the lane of `key` (None: the shared lane);
        BusUnavailable if it could not be stored. Returns the receipt for `withdraw_work` (0: none)."""

    @abstractmethod
    async def subscribe_work(
        self, subject: str, group: str, handler: Handler, ack_wait: float, key: str | None = None
    ) -> Subscription:
        """Deliver the lane `key` of the work queue `subject` (None: the shared lane, split between the
        members of `group`) to `handler`; each Message carries its `work` delivery, to settle within
        `ack_wait` seconds."""

    async def withdraw_work(self, subject: str, receipt: int) -> bool:
        """Take a stored message out of the work queue before anyone acknowledged it: True when it
        was still there (whoever holds a delivery of it can no longer settle it), False when it was
        gone (acknowledged, or nothing to withdraw)."""
        return False

    @abstractmethod
    async def settle_work(self, token: str, verdict: str) -> None:
        """ACK, PROGRESS, NAK or TERM a delivery by its token (an empty token: nothing to settle)."""

    async def claim(self, bucket: str, key: str, value: str) -> str:
        """First claim wins: store `value` under `key` in `bucket` unless a claim (younger than
        CLAIM_TTL_S) holds it, and return the value that holds: every caller on the bus gets the same
        one. For a decision several gateways must agree on (the router's worker for a new prefix)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no claims")

    @abstractmethod
    async def close(self) -> None: ...


class _InProcessSubscription(Subscription):
    def __init__(self, bus: InProcessTransport, subject: str, handler: Handler, queue: str | None) -> None:
        self.bus, self.subject, self.handler, self.queue = bus, subject, handler, queue
        self.inbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        while (msg := await self.inbox.get()) is not None:
            try:
                await self.handler(msg)
            except Exception:  # a failing handler must not stop delivery, as with NATS
                log.exception("handler for %s failed", self.subject)

    async def unsubscribe(self) -> None:
        subs = self.bus._subs.get(self.subject, [])
        if self not in subs:
            return
        subs.remove(self)
        self.inbox.put_nowait(None)
        if asyncio.current_task() is not self.task:  # called from its own handler: the pump ends after it
            await self.task


class InProcessTransport(Transport):
    """Subjects are exact names (no wildcards); delivery is in order per subscription."""

    in_process = True
    where = "in-process"

    def __init__(self) -> None:
        self._subs: dict[str, list[_InProcessSubscription]] = {}
        self._round_robin = itertools.count()
        self._claims: dict[tuple[str, str], tuple[str, float]] = {}  # -> (value, when claimed)

    async def publish(self, subject: str, data: bytes, reply: str | None = None) -> None:
        msg = Message(subject, data, reply)
        groups: dict[str, list[_InProcessSubscription]] = {}
        for sub in self._subs.get(subject, []):
            if sub.queue is None:
                sub.inbox.put_nowait(msg)
            else:
                groups.setdefault(sub.queue, []).append(sub)
        for members in groups.values():
            members[next(self._round_robin) % len(members)].inbox.put_nowait(msg)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: Message) -> None:
            if not answer.done():
                answer.set_result(msg.data)

        inbox = self.new_inbox()
        sub = await self.subscribe(inbox, on_reply)
        try:
            await self.publish(subject, data, reply=inbox)
            return await asyncio.wait_for(answer, timeout)
        finally:
            await sub.unsubscribe()

    def new_inbox(self) -> str:
        return f"_INBOX.{uuid.uuid4().hex}"

    async def subscribe(self, subject: str, handler: Handler, queue: str | None = None) -> Subscription:
        sub = _InProcessSubscription(self, subject, handler, queue)
        self._subs.setdefault(subject, []).append(sub)
        return sub

    async def publish_work(self, subject: str, data: bytes, key: str | None = None) -> int:
        # one process: a delivery cannot outlive its worker, so the queue is the plain queue group
        await self.publish(_work_subject(subject, key), data)
        return 0

    async def subscribe_work(
        self, subject: str, group: str, handler: Handler, ack_wait: float, key: str | None = None
    ) -> Subscription:
        async def deliver(msg: Message) -> None:
            await handler(msg._replace(subject=subject, work=Work("")))

        return await self.subscribe(_work_subject(subject, key), deliver, queue=group)

    async def settle_work(self, token: str, verdict: str) -> None:
        assert verdict in VERDICTS, verdict

    async def claim(self, bucket: str, key: str, value: str) -> str:
        now = time.monotonic()
        held = self._claims.get((bucket, key))
        if held is not None and now - held[1] < CLAIM_TTL_S:
            return held[0]
        if len(self._claims) > 100_000:
            self._claims = {k: v for k, v in self._claims.items() if now - v[1] < CLAIM_TTL_S}
        self._claims[(bucket, key)] = (value, now)
        return value

    async def close(self) -> None:
        for subs in list(self._subs.values()):
            for sub in list(subs):
                await sub.unsubscribe()


def _work_subject(subject: str, key: str | None = None) -> str:
    return f"_WORK.{work_lane(subject, key)}"


def work_lane(subject: str, key: str | None) -> str:
    """The subject a work-queue message travels on: the queue's own (shared), or `<queue>.<key>`."""
    return subject if key is None else f"{subject}.{key}"
