"""Liveness on the bus: each scheduler and detokenizer publishes a heartbeat every second; the gateway
fails in-flight requests when a pipeline goes quiet instead of letting clients hang."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import orjson

from shared.transport import Transport

INTERVAL_S = 1.0


class Heartbeat:
    def __init__(self, transport: Transport, subject: str, service: str, worker: str,
                 alive: Callable[[], bool] = lambda: True, extra: dict | None = None) -> None:  # fmt: skip
        """`alive`: whether the part that does the work still runs (a dead step thread must not be
        covered by a live event loop's heartbeat)."""
        self.transport, self.subject, self.alive = transport, subject, alive
        self.payload = {"service": service, "worker": worker, **(extra or {})}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while self.alive():
            with contextlib.suppress(Exception):  # a bus hiccup must not end the heartbeat
                await self.transport.publish(
                    self.subject, orjson.dumps({**self.payload, "time": time.time()})
                )
            await asyncio.sleep(INTERVAL_S)
