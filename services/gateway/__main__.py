"""`python -m services.gateway --nats-url ... --port 30000`: the HTTP API and the bus API.

SIGTERM / SIGINT drain it: new requests get a 503, those in flight may finish for up to
--shutdown-timeout seconds and the rest end with an error saying so (Gateway.drain); a second signal
ends the drain at once. Only then does uvicorn close the port and the connections."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import ssl
from collections.abc import Iterator

import uvicorn

from services.gateway.config import GatewayConfig
from services.gateway.http_app import build_app
from services.gateway.http_protocol import header_deadline
from services.gateway.image_inputs import ImageInputs
from services.gateway.service import ANSWER_S, Gateway
from shared.config import add_cli_args, cli_overrides, from_env
from shared.gc_freeze import freeze_startup_objects
from shared.media import MediaLimits
from shared.model_config import ModelConfig
from shared.model_files import default_model_path
from shared.nats_server import port_in_use
from shared.service_main import (
    ServiceExit,
    add_bus_args,
    add_log_args,
    bus_auth,
    connect,
    load_checked,
    model_folder,
    run,
    shutdown,
)
from shared.tokenizer import load_tokenizer
from shared.watchdog import start_watchdog

log = logging.getLogger("services.gateway")
_READY_POLL_S = 0.1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_bus_args(parser, url=False)  # --nats-url is GatewayConfig.nats_url
    add_log_args(parser)
    add_cli_args(parser, GatewayConfig)
    return parser


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway drains first (main), then sets should_exit.
    (uvicorn's handlers would begin its shutdown at once, give requests timeout_graceful_shutdown,
    then raise the signal again, ending the process before the gateway could stop.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other gateways of this host may bind too (SO_REUSEPORT):
    the kernel spreads new connections over them, so several processes stream the responses."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServiceExit(f"cannot listen on {host}:{port}: {e.strerror}; pick another with --port") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg: GatewayConfig = from_env(GatewayConfig, **cli_overrides(args, GatewayConfig))
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    async def amain() -> None:
        # uvicorn would find out only after the model is loaded (gateways sharing the port: at bind)
        if not cfg.reuse_port and port_in_use(cfg.host, cfg.port):
            raise ServiceExit(
                f"port {cfg.port} on {cfg.host} is in use by another process; pick another with --port"
            )
        check_tls_files(cfg)
        folder = model_folder(cfg.model_path, need_weights=False)
        tokenizer_path = cfg.tokenizer_path or folder
        tokenizer = load_checked(f"the tokenizer of {tokenizer_path}", lambda: load_tokenizer(tokenizer_path))
        model = load_checked(f"the model config of {folder}", lambda: ModelConfig.from_folder(folder))
        limits = MediaLimits(media_dir=cfg.allowed_media_dir)
        images = load_checked(f"the image processor of {folder}",
                              lambda: ImageInputs.from_folder(folder, model.vocab_size, limits))  # fmt: skip
        transport = await connect(cfg.nats_url, "gateway", bus_auth(args))
        gateway = Gateway(
            cfg, transport, tokenizer, model, cfg.model_path or default_model_path(), tokenizer_path, images
        )
        await gateway.start()
        freeze_startup_objects()  # no full-collection stalls of the HTTP loop (shared/gc_freeze.py)
        stop, now = asyncio.Event(), asyncio.Event()  # the first signal drains, a second ends the drain
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: (now if stop.is_set() else stop).set())
        watchdog = start_watchdog()  # `sglbus serve` restarts a gateway whose event loop stops
        try:
            await _serve(cfg, gateway, stop, now)
        finally:
            if watchdog is not None:
                watchdog.stop()
            await shutdown("gateway", gateway.stop(), transport)

    run("gateway", amain, args.log_level)


def check_tls_files(cfg: GatewayConfig) -> None:
    """A certificate and key that do not load (not PEM, not a pair) are a configuration error, said at
    start, not a traceback from uvicorn once the model is loaded."""
    if cfg.ssl_certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ServiceExit(f"cannot serve HTTPS with {cfg.ssl_certfile} and {cfg.ssl_keyfile}: {e}") from None


async def _serve(cfg: GatewayConfig, gateway: Gateway, stop: asyncio.Event, now: asyncio.Event) -> None:
    """HTTP until `stop` is set, then the drain, then uvicorn's shutdown (the responses of the requests
    the drain ended go out within ANSWER_S)."""
    server = _Server(uvicorn.Config(build_app(gateway), host=cfg.host, port=cfg.port, log_level="warning",
                                    timeout_graceful_shutdown=ANSWER_S, limit_concurrency=cfg.max_connections,
                                    ssl_certfile=cfg.ssl_certfile, ssl_keyfile=cfg.ssl_keyfile,
                                    http=header_deadline()))  # fmt: skip
    sockets = None
    if cfg.reuse_port:
        # join the shared port only once this gateway can serve: the kernel hands a connection to
        # any socket bound to it, and one that is still starting would answer 503 beside one that
        # is ready (serve prints its URL at the first 200, as a gateway restarted later would)
        while not gateway.ready and not stop.is_set():
            await asyncio.sleep(_READY_POLL_S)
        if stop.is_set():
            return
        sockets = [shared_port_socket(cfg.host, cfg.port)]
    log.info("gateway listening on %s://%s:%d%s", "https" if cfg.ssl_certfile else "http", cfg.host, cfg.port,
             " (API key required)" if cfg.api_key else "")  # fmt: skip
    serving = asyncio.ensure_future(server.serve(sockets))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not serving.done():
        await gateway.drain(cfg.shutdown_timeout, now)
        server.should_exit = True
    await serving  # uvicorn's own failure (it exits on a port it cannot bind) is raised here


if __name__ == "__main__":
    main()
