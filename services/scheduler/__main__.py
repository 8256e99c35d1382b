"""`python -m services.scheduler --nats-url ...`: one scheduler (model, KV cache, batching) on the bus."""

from __future__ import annotations

import argparse
import logging

from services.scheduler.service import SchedulerService
from shared.config import EngineConfig, add_cli_args, cli_overrides
from shared.nats_transport import NatsTransport
from shared.service_main import add_bus_args, run, wait_for_signal

log = logging.getLogger("services.scheduler")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    add_bus_args(parser)
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args(argv)
    cfg = EngineConfig.from_env(**cli_overrides(args, EngineConfig))

    async def amain() -> None:
        transport = await NatsTransport.connect(args.nats_url, name=f"scheduler-{cfg.worker_id}")
        service = SchedulerService(cfg, transport)  # loads the model (seconds) before subscribing
        await service.start()
        log.info("scheduler %s ready: %s", cfg.worker_id, service.runner.model_config.architecture)
        await wait_for_signal()
        await service.stop()
        await transport.close()

    run("scheduler", amain)


if __name__ == "__main__":
    main()
