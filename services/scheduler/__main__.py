"""`python -m services.scheduler --nats-url ...`: one scheduler (model, KV cache, batching) on the bus."""

from __future__ import annotations

import argparse

from services.scheduler.service import SchedulerService
from shared.config import EngineConfig, add_cli_args, cli_overrides
from shared.service_main import add_bus_args, run, serve_on_bus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    add_bus_args(parser)
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args(argv)
    cfg = EngineConfig.from_env(**cli_overrides(args, EngineConfig))

    async def amain() -> None:
        # the service loads the model (seconds) before it subscribes
        await serve_on_bus(
            f"scheduler-{cfg.worker_id}", args.nats_url, lambda bus: SchedulerService(cfg, bus)
        )

    run("scheduler", amain)


if __name__ == "__main__":
    main()
