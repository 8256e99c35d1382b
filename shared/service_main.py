"""What every service process does the same way: logging, NATS connection, run until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def add_bus_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=os.environ.get("SGLBUS_NATS_URL", DEFAULT_NATS_URL))


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("SGLBUS_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


async def wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def serve_on_bus(name: str, nats_url: str, make_service: Callable[[Any], Service]) -> None:
    """Connect to NATS, build and start the service, run until SIGINT/SIGTERM, stop it, disconnect."""
    from shared.nats_transport import NatsTransport

    transport = await NatsTransport.connect(nats_url, name=name)
    service = make_service(transport)
    await service.start()
    logging.getLogger(name).info("%s ready", name)
    await wait_for_signal()
    await service.stop()
    await transport.close()


def run(name: str, amain: Callable[[], Awaitable[None]]) -> None:
    setup_logging(name)
    try:
        import uvloop  # optional: faster event loop where installed

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(amain())
