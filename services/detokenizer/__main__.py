"""`python -m services.detokenizer --nats-url ...`: the detokenizer of one scheduler worker."""

from __future__ import annotations

import argparse
import os

from services.detokenizer.service import DetokenizerService
from shared.model_files import resolve_model_folder
from shared.service_main import add_bus_args, run, serve_on_bus
from shared.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m services.detokenizer", description=__doc__)
    add_bus_args(parser)
    parser.add_argument("--model-path", default=env("SGLBUS_MODEL_PATH"))
    parser.add_argument("--tokenizer-path", default=env("SGLBUS_TOKENIZER_PATH"))
    parser.add_argument("--subject-prefix", default=env("SGLBUS_SUBJECT_PREFIX", "sglbus"))
    parser.add_argument("--worker-id", default=env("SGLBUS_WORKER_ID", "0"))
    args = parser.parse_args(argv)

    async def amain() -> None:
        tokenizer = load_tokenizer(
            args.tokenizer_path or resolve_model_folder(args.model_path, need_weights=False)
        )
        await serve_on_bus(
            f"detokenizer-{args.worker_id}",
            args.nats_url,
            lambda bus: DetokenizerService(tokenizer, bus, args.subject_prefix, args.worker_id),
        )

    run("detokenizer", amain)


if __name__ == "__main__":
    main()
