"""The bus behind one small interface: publish bytes to a subject, subscribe a handler to a subject.

Two implementations: NATS in production (next to this file, later) and `InProcessTransport`, which
`sglbus.Engine` and unit tests use, so offline and served runs share every service's code.
Handlers are coroutines; a subscription delivers its messages in order, one at a time.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Handler = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True)
class Subjects:
    """Subject names, under a configurable prefix so several deployments can share one NATS."""

    prefix: str = "sglbus"

    @property
    def req(self) -> str:
        return f"{self.prefix}.req"

    @property
    def abort(self) -> str:
        return f"{self.prefix}.abort"

    def detok(self, worker: str) -> str:
        return f"{self.prefix}.detok.{worker}"

    def out(self, gateway: str) -> str:
        return f"{self.prefix}.out.{gateway}"


class Subscription(ABC):
    @abstractmethod
    async def unsubscribe(self) -> None: ...


class Transport(ABC):
    @abstractmethod
    async def publish(self, subject: str, data: bytes) -> None: ...

    @abstractmethod
    async def subscribe(self, subject: str, handler: Handler, queue: str | None = None) -> Subscription:
        """Deliver messages on `subject` to `handler`. Subscribers sharing a `queue` name split the
        messages between them (each message goes to one of them); others each get every message."""

    @abstractmethod
    async def close(self) -> None: ...


class _InProcessSubscription(Subscription):
    def __init__(self, bus: InProcessTransport, subject: str, handler: Handler, queue: str | None) -> None:
        self.bus, self.subject, self.handler, self.queue = bus, subject, handler, queue
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        while (data := await self.inbox.get()) is not None:
            try:
                await self.handler(data)
            except Exception:  # a failing handler must not stop delivery, as with NATS
                import logging

                logging.getLogger(__name__).exception("handler for %s failed", self.subject)

    async def unsubscribe(self) -> None:
        self.bus._subs[self.subject].remove(self)
        self.inbox.put_nowait(None)
        await self.task


class InProcessTransport(Transport):
    """Subjects are exact names (no wildcards); delivery is in order per subscription."""

    def __init__(self) -> None:
        self._subs: dict[str, list[_InProcessSubscription]] = {}
        self._round_robin = itertools.count()

    async def publish(self, subject: str, data: bytes) -> None:
        subs = self._subs.get(subject, [])
        groups: dict[str, list[_InProcessSubscription]] = {}
        for sub in subs:
            if sub.queue is None:
                sub.inbox.put_nowait(data)
            else:
                groups.setdefault(sub.queue, []).append(sub)
        for members in groups.values():
            members[next(self._round_robin) % len(members)].inbox.put_nowait(data)

    async def subscribe(self, subject: str, handler: Handler, queue: str | None = None) -> Subscription:
        sub = _InProcessSubscription(self, subject, handler, queue)
        self._subs.setdefault(subject, []).append(sub)
        return sub

    async def close(self) -> None:
        for subs in list(self._subs.values()):
            for sub in list(subs):
                await sub.unsubscribe()
