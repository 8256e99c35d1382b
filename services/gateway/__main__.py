"""`python -m services.gateway --nats-url ... --port 30000`: the HTTP API and the bus API."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from services.gateway.config import GatewayConfig
from services.gateway.http_app import build_app
from services.gateway.service import Gateway
from shared.config import add_cli_args, cli_overrides, from_env
from shared.model_config import ModelConfig
from shared.model_files import default_model_path, resolve_model_folder
from shared.nats_transport import NatsTransport
from shared.service_main import run
from shared.tokenizer import load_tokenizer

log = logging.getLogger("services.gateway")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_cli_args(parser, GatewayConfig)
    args = parser.parse_args(argv)
    cfg: GatewayConfig = from_env(GatewayConfig, **cli_overrides(args, GatewayConfig))

    async def amain() -> None:
        folder = resolve_model_folder(cfg.model_path, need_weights=False)
        tokenizer_path = cfg.tokenizer_path or folder
        tokenizer = load_tokenizer(tokenizer_path)
        transport = await NatsTransport.connect(cfg.nats_url, name="gateway")
        gateway = Gateway(cfg, transport, tokenizer, ModelConfig.from_folder(folder),
                          cfg.model_path or default_model_path(), tokenizer_path)  # fmt: skip
        await gateway.start()
        server = uvicorn.Server(uvicorn.Config(build_app(gateway), host=cfg.host, port=cfg.port,
                                               log_level="warning", timeout_graceful_shutdown=5))  # fmt: skip
        log.info("gateway listening on http://%s:%d", cfg.host, cfg.port)
        await server.serve()  # returns on SIGINT/SIGTERM (uvicorn installs the handlers)
        await gateway.stop()
        await transport.close()

    run("gateway", amain)


if __name__ == "__main__":
    main()
