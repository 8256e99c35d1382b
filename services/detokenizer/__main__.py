"""`python -m services.detokenizer --nats-url ...`: the detokenizer of one scheduler worker."""

from __future__ import annotations

import argparse

from services.detokenizer.service import DetokenizerService
from shared.config import EngineConfig, add_cli_args, cli_overrides
from shared.service_main import (
    add_bus_args,
    add_log_args,
    bus_auth,
    load_checked,
    model_folder,
    run,
    serve_on_bus,
)
from shared.tokenizer import load_tokenizer

OPTIONS = ("model_path", "tokenizer_path", "subject_prefix", "worker_id")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.detokenizer", description=__doc__)
    add_bus_args(parser)
    add_log_args(parser)
    add_cli_args(parser, EngineConfig, only=OPTIONS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = EngineConfig.from_env(**cli_overrides(args, EngineConfig))
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    async def amain() -> None:
        path = cfg.tokenizer_path or model_folder(cfg.model_path, need_weights=False)
        tokenizer = load_checked(f"the tokenizer of {path}", lambda: load_tokenizer(path))
        await serve_on_bus(
            f"detokenizer-{cfg.worker_id}",
            args.nats_url,
            lambda bus: DetokenizerService(tokenizer, bus, cfg.subject_prefix, cfg.worker_id),
            bus_auth(args),
        )

    run("detokenizer", amain, args.log_level)


if __name__ == "__main__":
    main()
