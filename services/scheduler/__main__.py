"""`python -m services.scheduler --nats-url ...`: one scheduler (model, KV cache, batching) on the bus."""

from __future__ import annotations

import argparse

from services.scheduler.service import SchedulerService
from shared.config import EngineConfig, add_cli_args, cli_overrides
from shared.service_main import add_bus_args, add_log_args, bus_auth, model_folder, run, serve_on_bus


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    add_bus_args(parser)
    add_log_args(parser)
    add_cli_args(parser, EngineConfig)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = EngineConfig.from_env(**cli_overrides(args, EngineConfig))
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    async def amain() -> None:
        model_folder(cfg.model_path, cfg.load_format != "dummy")  # a bad path: one line, exit 2
        # the service loads the model (seconds) before it subscribes
        await serve_on_bus(f"scheduler-{cfg.worker_id}", args.nats_url,
                           lambda bus: SchedulerService(cfg, bus), bus_auth(args))  # fmt: skip

    run("scheduler", amain, args.log_level)


if __name__ == "__main__":
    main()
