"""What every service process does the same way: bus and logging options, the NATS connection, running
until SIGINT/SIGTERM, and a configuration error reported as one line with exit code 2."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from shared.gc_freeze import freeze_startup_objects
from shared.nats_transport import BusAuth, NatsTransport, redact_url
from shared.watchdog import start_watchdog

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
LOG_LEVELS = ("debug", "info", "warning", "error")
# A bad option or model: restarting cannot help, so `sglbus serve` stops instead (argparse exits 2 too).
EXIT_CONFIG = 2
# Stopping waits on the bus (unsubscribe, drain): with NATS gone it could wait forever. Bounded, so a
# SIGTERM always ends the process, within `sglbus serve`'s 15 s and compose's 30 s grace periods.
STOP_TIMEOUT_S, CLOSE_TIMEOUT_S = 8.0, 4.0

T = TypeVar("T")
log = logging.getLogger(__name__)


class ServiceExit(Exception):
    """Ends the service process with one line on stderr and `exit_code`: EXIT_CONFIG for a bad option
    or model (not worth a restart), 1 for what a restart may cure (NATS unreachable, a dead step)."""

    def __init__(self, message: str, exit_code: int = EXIT_CONFIG) -> None:
        super().__init__(message)
        self.exit_code = exit_code


_CREDENTIALS = (
    ("token", "token the NATS server requires"),
    ("user", "user name for NATS, with --nats-password"),
    ("password", "password for NATS"),
    ("creds", "path of a NATS .creds file (JWT + nkey seed)"),
    ("tls_ca", "CA file (PEM) the NATS server's TLS certificate must chain to; unset: the system's CAs"),
)
# JetStream keeps a stream on at most 5 nodes
MAX_NATS_REPLICAS = 5


@dataclass(frozen=True)
class BusOptions(BusAuth):
    """What a service's bus options say beyond the URL: its credentials, and on how many NATS nodes
    the work queue keeps each message (every service must say the same: each makes the stream so)."""

    stream_replicas: int = 1


def _replicas(raw: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_NATS_REPLICAS:  # also checks the environment's value
        raise argparse.ArgumentTypeError(f"{raw!r} is not a replica count from 1 to {MAX_NATS_REPLICAS}")
    return n


def add_bus_args(
    parser: argparse.ArgumentParser, url: bool = True, token_default: str = "unset"
) -> argparse._ArgumentGroup:
    """--nats-url (unless the caller has its own) and the credentials NATS may ask for, in a group the
    caller can add to. Secrets are better passed in the environment: `ps` shows command lines."""
    env = os.environ.get
    g = parser.add_argument_group("NATS bus")
    if url:
        text = f"the NATS server (default: {DEFAULT_NATS_URL}; env SGLBUS_NATS_URL)"
        g.add_argument("--nats-url", default=env("SGLBUS_NATS_URL", DEFAULT_NATS_URL), help=text)
    for name, text in _CREDENTIALS:
        var, default = f"SGLBUS_NATS_{name.upper()}", token_default if name == "token" else "unset"
        g.add_argument("--nats-" + name.replace("_", "-"), default=env(var),
                       help=f"{text} (default: {default}; env {var})")  # fmt: skip
    g.add_argument("--nats-replicas", type=_replicas, default=env("SGLBUS_NATS_REPLICAS"),
                   help="NATS nodes that keep each message of the work queue: 3 on a cluster of 3 or more "
                        "(any one node may die), the same for every service (default: 1; env "
                        "SGLBUS_NATS_REPLICAS)")  # fmt: skip
    return g


def bus_auth(args: argparse.Namespace) -> BusOptions:
    return BusOptions(token=args.nats_token or None, user=args.nats_user or None,
                      password=args.nats_password or None, creds=args.nats_creds or None,
                      tls_ca=args.nats_tls_ca or None, stream_replicas=args.nats_replicas or 1)  # fmt: skip


def _log_level(raw: str) -> str:
    level = raw.lower()
    if level not in LOG_LEVELS:  # also checks the environment's value (argparse types string defaults)
        raise argparse.ArgumentTypeError(f"{raw!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def add_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", type=_log_level, choices=LOG_LEVELS,
                        default=os.environ.get("SGLBUS_LOG_LEVEL", "info"),
                        help="logging level (default: info; env SGLBUS_LOG_LEVEL)")  # fmt: skip


def setup_logging(name: str, level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


def model_folder(model_path: str | None, need_weights: bool = True) -> str:
    """The model's folder (converting a GGUF once); ServiceExit with one readable line when the path
    or the file is bad."""
    from shared.model_files import resolve_model_folder  # imports torch: only where a model is needed

    try:
        return resolve_model_folder(model_path, need_weights)
    except Exception as e:  # a corrupt file fails deep inside the GGUF reader with any error type
        raise ServiceExit(_model_error(model_path, e)) from e


def load_checked(what: str, load: Callable[[], T]) -> T:
    """load(), with any error turned into a ServiceExit naming `what` (e.g. a broken tokenizer file)."""
    try:
        return load()
    except Exception as e:
        raise ServiceExit(f"cannot load {what}: {type(e).__name__}: {e}") from e


def _model_error(model_path: str | None, e: Exception) -> str:
    what = str(e) if isinstance(e, OSError | ValueError) else f"{type(e).__name__}: {e}"
    if model_path is not None and os.path.expanduser(model_path) not in what:
        what = f"cannot load model {model_path}: {what}"
    return what


async def wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    # optional: `async def wait_failed(self) -> str`, returning why once the service cannot go on;
    # `def stalled_for(self) -> float`, seconds its own work has gone without progress (the watchdog's)


async def connect(nats_url: str, name: str, bus: BusOptions | None = None) -> NatsTransport:
    """`nats_url`: one server or a cluster's nodes, comma-separated."""
    replicas = bus.stream_replicas if bus else 1
    try:
        transport = await NatsTransport.connect(nats_url, name=name, auth=bus, stream_replicas=replicas)
    except ValueError as e:  # no server in the URL
        raise ServiceExit(str(e)) from None
    except TimeoutError as e:  # NATS down: exit 1, a supervisor retries
        raise ServiceExit(f"{e}: is NATS running there?", exit_code=1) from None
    except PermissionError as e:  # wrong credentials: a restart cannot help
        raise ServiceExit(str(e)) from None
    try:
        await transport.check_jetstream(redact_url(nats_url))
    except (LookupError, TimeoutError) as e:  # no JetStream: a restart cannot help; not ready: it may
        await transport.close()
        raise ServiceExit(str(e), exit_code=EXIT_CONFIG if isinstance(e, LookupError) else 1) from None
    return transport


async def serve_on_bus(
    name: str, nats_url: str, make_service: Callable[[Any], Service], bus: BusOptions | None = None
) -> None:
    """Connect to NATS, build and start the service, run until SIGINT/SIGTERM, stop it, disconnect.
    Building the service loads the model: an error there is a configuration error, not a crash."""
    transport = await connect(nats_url, name, bus)
    try:
        service = make_service(transport)
    except Exception as e:
        await transport.close()
        log.debug("%s: building the service failed", name, exc_info=True)
        raise ServiceExit(f"cannot start {name}: {type(e).__name__}: {e}") from e
    await service.start()
    freeze_startup_objects()  # no full-collection stalls of the running service (shared/gc_freeze.py)
    logging.getLogger(name).info("%s ready", name)
    watchdog = start_watchdog(getattr(service, "stalled_for", None))  # under `sglbus serve`
    stopped = asyncio.ensure_future(wait_for_signal())
    failed = asyncio.ensure_future(service.wait_failed()) if hasattr(service, "wait_failed") else None
    await asyncio.wait([t for t in (stopped, failed) if t is not None], return_when=asyncio.FIRST_COMPLETED)
    reason = failed.result() if failed is not None and failed.done() else None
    for task in (stopped, failed):
        if task is not None:
            task.cancel()
    if watchdog is not None:
        watchdog.stop()
    await shutdown(name, service.stop(), transport)
    if reason is not None:  # exit non-zero: a supervisor (sglbus serve, compose) restarts the process
        raise ServiceExit(f"{name} failed: {reason}", exit_code=1)


async def shutdown(name: str, stop: Awaitable[None], transport: NatsTransport) -> None:
    """Await the service's stop, then close the bus connection, each within its bound."""
    await _within(name, "stop", stop, STOP_TIMEOUT_S)
    await _within(name, "bus close", transport.close(), CLOSE_TIMEOUT_S)


async def _within(name: str, what: str, step: Awaitable[None], limit: float) -> None:
    try:
        await asyncio.wait_for(step, limit)
    except TimeoutError:
        log.warning("%s: %s did not finish within %.0f s (is NATS down?); exiting anyway", name, what, limit)


def run(name: str, amain: Callable[[], Awaitable[None]], log_level: str = "info") -> None:
    """Run the service's main coroutine; a ServiceExit ends the process with one line and its code."""
    setup_logging(name, log_level)
    try:  # uvloop where installed (a dependency except on Windows): the faster event loop
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    try:
        run_loop(amain())
    except ServiceExit as e:
        logging.getLogger(name).error("%s", e)
        sys.exit(e.exit_code)
