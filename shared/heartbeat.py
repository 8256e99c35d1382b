"""Liveness on the bus: each scheduler and detokenizer publishes a heartbeat every second; the gateway
fails in-flight requests when a pipeline goes quiet instead of letting clients hang."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable

import orjson

from shared.transport import Transport

INTERVAL_S = 1.0


class Heartbeat:
    def __init__(self, transport: Transport, subject: str, service: str, worker: str,
                 alive: Callable[[], bool] = lambda: True, extra: dict | None = None,
                 report: Callable[[], dict] | None = None) -> None:  # fmt: skip
        """`alive`: whether the part that does the work still runs (a dead step thread must not be
        covered by a live event loop's heartbeat). `report`: fields read anew for every beat (a
        scheduler's metrics)."""
        self.transport, self.subject, self.alive, self.report = transport, subject, alive, report
        # instance: this run of the service (a restarted one has a new one, under the same worker id)
        self.payload = {
            "service": service,
            "worker": worker,
            "instance": uuid.uuid4().hex[:12],
            **(extra or {}),
        }
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop beating and say goodbye (`leaving`): the gateway stops counting on a service that
        stopped on purpose at once, instead of after its liveness timeout."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            with contextlib.suppress(Exception):  # NATS may be gone already: then the timeout decides
                beat = {**self.payload, "time": time.time(), "leaving": True}
                await asyncio.wait_for(self.transport.publish(self.subject, orjson.dumps(beat)), 1.0)

    async def _run(self) -> None:
        while self.alive():
            with contextlib.suppress(Exception):  # a bus hiccup must not end the heartbeat
                beat = {**self.payload, **(self.report() if self.report else {}), "time": time.time()}
                await self.transport.publish(self.subject, orjson.dumps(beat))
            await asyncio.sleep(INTERVAL_S)
