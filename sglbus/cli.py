"""The `sglbus` command: `sglbus serve [args]`, `sglbus bench LEAF [args]`.

Bench leaves: offline, serving, bus-latency, health-latency, large-batches, logprob-b64.

Each leaf subcommand owns its argument parser (so it also runs as `python -m <module>`); this file only
routes to it. A leaf is declared without its own options and with add_help=False, so every argument
after its name, `--help` included, is left unparsed here and forwarded to the leaf's `main(argv, prog)`.
`serve` is an entry of the same shape.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Leaf = Callable[[list[str], str], int]


def _bench_offline(argv: list[str], prog: str) -> int:
    # imported on use: `sglbus --help` must not pay for torch and transformers
    from benchmarks.offline import main

    return main(argv, prog)


def _bench_serving(argv: list[str], prog: str) -> int:
    from benchmarks.serving import main

    return main(argv, prog)


def _bench_bus_latency(argv: list[str], prog: str) -> int:
    from benchmarks.bus_latency import main

    return main(argv, prog)


def _bench_logprob_b64(argv: list[str], prog: str) -> int:
    from benchmarks.logprob_b64 import main

    return main(argv, prog)


def _bench_health_latency(argv: list[str], prog: str) -> int:
    from benchmarks.health_latency import main

    return main(argv, prog)


def _bench_large_batches(argv: list[str], prog: str) -> int:
    from benchmarks.large_batches import main

    return main(argv, prog)


def _serve(argv: list[str], prog: str) -> int:
    from sglbus.serve import main

    return main(argv)


_TOP: dict[str, tuple[str, Leaf]] = {
    "serve": ("start NATS (embedded), the scheduler, detokenizer and gateway; serve HTTP", _serve),
}
# (group, name) -> (help, entry point)
_LEAVES: dict[tuple[str, str], tuple[str, Leaf]] = {
    ("bench", "offline"): (
        "offline throughput of sglbus.Engine (SGLang's bench_offline_throughput)",
        _bench_offline,
    ),
    ("bench", "serving"): (
        "online serving against a /generate server (SGLang's bench_serving)",
        _bench_serving,
    ),
    ("bench", "bus-latency"): (
        "latency the bus path adds to a request, over HTTP and the bus API",
        _bench_bus_latency,
    ),
    ("bench", "health-latency"): (
        "how fast /health answers while the gateway takes the largest requests it accepts",
        _bench_health_latency,
    ),
    ("bench", "large-batches"): (
        "large batches on a busy machine: does any request fail wrongly?",
        _bench_large_batches,
    ),
    ("bench", "logprob-b64"): (
        "flat prompt top-logprob arrays: JSON lists vs base64, server and client cost",
        _bench_logprob_b64,
    ),
}
_GROUPS = {"bench": "benchmarks"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglbus", description="sglbus: an LLM serving system")
    groups = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
    for name, (help_text, _) in _TOP.items():
        groups.add_parser(name, help=help_text, add_help=False)
    subparsers: dict[str, argparse._SubParsersAction] = {}
    for group, help_text in _GROUPS.items():
        gp = groups.add_parser(group, help=help_text, description=help_text)
        subparsers[group] = gp.add_subparsers(dest="leaf", required=True, metavar="SUBCOMMAND")
    for (group, name), (help_text, _) in _LEAVES.items():
        subparsers[group].add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.group in _TOP:
        return _TOP[args.group][1](rest, f"sglbus {args.group}")
    _, entry = _LEAVES[(args.group, args.leaf)]
    return entry(rest, f"sglbus {args.group} {args.leaf}")


if __name__ == "__main__":
    sys.exit(main())
