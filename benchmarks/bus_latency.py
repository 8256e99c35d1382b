"""Latency the bus path adds to a request (gateway -> scheduler -> detokenizer -> gateway) at low load.

Sequential 1-token requests with short prompts (fresh random ids each, so no prefix cache hits) go
alternately through (a) HTTP `POST /generate` and (b) the bus API (a NATS request to
`<prefix>.api.generate`). Around each request, outside the timed span, `GET /get_server_info` reads the
scheduler's cumulative `stats.step_s`; with one request in flight the delta is that request's scheduler
time, and added latency = e2e - scheduler step time (client, HTTP, gateway, NATS hops, detokenizer).
The gateway's own `stats.bus_s` (request published -> final output received) gives the bus path proper
(gateway -> scheduler -> detokenizer -> gateway): bus path added = that delta - scheduler step time.
For reference, a bare NATS request/reply round trip (two client connections, an echo responder) on
the same NATS server.

    sglbus bench bus-latency --launch-server
    python -m benchmarks.bus_latency --base-url http://127.0.0.1:30000 --nats-url nats://127.0.0.1:4222
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import nats
import orjson

from benchmarks.launch import add_target_args, append_result, machine_info, percentile, target
from benchmarks.workloads import FIRST_SAFE_ID

Send = Callable[[list[int]], Awaitable[None]]


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_target_args(p, nats=True)
    p.add_argument("--subject-prefix", default=None, help="default: the server's (get_server_info)")
    p.add_argument("--num-requests", type=int, default=200, help="per path")
    p.add_argument("--warmup", type=int, default=10, help="untimed requests per path first")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--pause-ms", type=float, default=50.0, help="idle gap between stats read and request")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSONL row")
    return p.parse_args(argv)


def _params() -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def _check(resp: Any) -> None:
    if not isinstance(resp, dict) or "error" in resp or resp["meta_info"]["completion_tokens"] != 1:
        raise RuntimeError(f"unexpected response: {str(resp)[:300]}")


async def _stats(client: httpx.AsyncClient, base: str) -> dict[str, Any]:
    r = await client.get(base + "/get_server_info")
    r.raise_for_status()
    info = r.json()
    return {**info["stats"], "bus_s": info.get("gateway", {}).get("stats", {}).get("bus_s", float("nan"))}


async def _nats_rtt(nats_url: str, token: str | None, n: int) -> list[float]:
    """Round trips of a small request to an echo responder on another connection, in ms."""
    responder, requester = (
        await nats.connect(nats_url, token=token),
        await nats.connect(nats_url, token=token),
    )
    subject = f"_bench.echo.{uuid.uuid4().hex}"

    async def echo(msg: Any) -> None:
        await responder.publish(msg.reply, msg.data)

    sub = await responder.subscribe(subject, cb=echo)
    await responder.flush()
    payload = b"x" * 128
    out: list[float] = []
    try:
        for i in range(n + 10):
            t0 = time.perf_counter()
            await requester.request(subject, payload, timeout=5)
            if i >= 10:  # the first few set up the reply inbox
                out.append((time.perf_counter() - t0) * 1000)
    finally:
        await sub.unsubscribe()
        await requester.close()
        await responder.close()
    return out


async def measure(args: argparse.Namespace, base: str, nats_url: str, token: str | None) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=60) as client:
        info = (await client.get(base + "/get_server_info")).json()
        prefix = args.subject_prefix or info.get("subject_prefix", "sglbus")
        vocab = int(info.get("vocab_size", 32000))
        nc = await nats.connect(nats_url, token=token)

        async def via_http(ids: list[int]) -> None:
            r = await client.post(base + "/generate", json={"input_ids": ids, "sampling_params": _params()})
            r.raise_for_status()
            _check(r.json())

        async def via_bus(ids: list[int]) -> None:
            body = orjson.dumps({"input_ids": ids, "sampling_params": _params()})
            _check(orjson.loads((await nc.request(f"{prefix}.api.generate", body, timeout=60)).data))

        paths: dict[str, Send] = {"http": via_http, "bus": via_bus}
        rows: dict[str, list[tuple[float, float, float, int, float]]] = {k: [] for k in paths}
        try:
            for i in range(args.warmup + args.num_requests):
                for name, send in paths.items():  # alternate, so drifting machine load hits both alike
                    ids = [rng.randrange(FIRST_SAFE_ID, vocab) for _ in range(args.prompt_len)]
                    before = await _stats(client, base)
                    await asyncio.sleep(args.pause_ms / 1000)
                    t0 = time.perf_counter()
                    await send(ids)
                    e2e = time.perf_counter() - t0
                    after = await _stats(client, base)
                    if i >= args.warmup:
                        d = {k: after[k] - before[k] for k in ("step_s", "forward_s", "steps", "bus_s")}
                        ms = [d[k] * 1000 for k in ("step_s", "forward_s", "bus_s")]
                        rows[name].append((e2e * 1000, ms[0], ms[1], d["steps"], ms[2]))
        finally:
            await nc.close()
    rtt = await _nats_rtt(nats_url, token, args.num_requests)
    result: dict[str, Any] = {
        "nats_rtt_median_ms": percentile(rtt, 50),
        "nats_rtt_p90_ms": percentile(rtt, 90),
    }
    for name, rs in rows.items():
        e2e = [r[0] for r in rs]
        added = [r[0] - r[1] for r in rs]
        bus = [r[4] - r[1] for r in rs]
        result[name] = {
            "e2e_median_ms": percentile(e2e, 50),
            "e2e_p90_ms": percentile(e2e, 90),
            "e2e_p99_ms": percentile(e2e, 99),
            "step_median_ms": percentile([r[1] for r in rs], 50),
            "forward_median_ms": percentile([r[2] for r in rs], 50),
            "steps_per_request": sum(r[3] for r in rs) / max(len(rs), 1),
            "added_median_ms": percentile(added, 50),
            "added_p90_ms": percentile(added, 90),
            "added_p99_ms": percentile(added, 99),
            "bus_added_median_ms": percentile(bus, 50),
            "bus_added_p90_ms": percentile(bus, 90),
        }
    return result


def print_block(args: argparse.Namespace, r: dict[str, Any]) -> None:
    print("\n{s:{c}^{n}}".format(s=" Bus Latency Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Requests per path:", args.num_requests))
    print("{:<40} {:<10}".format("Prompt tokens / max_new_tokens:", f"{args.prompt_len} / 1"))
    print("{:<40} {:<10.3f}".format("Bare NATS request/reply median (ms):", r["nats_rtt_median_ms"]))
    titles = {"http": "HTTP POST /generate", "bus": "Bus API (NATS api.generate)"}
    labels = [("Median E2E (ms):", "e2e_median_ms"), ("P90 E2E (ms):", "e2e_p90_ms"),
              ("P99 E2E (ms):", "e2e_p99_ms"), ("Median scheduler step time (ms):", "step_median_ms"),
              ("Median forward time (ms):", "forward_median_ms"), ("Steps per request:", "steps_per_request"),
              ("Median added latency (ms):", "added_median_ms"), ("P90 added latency (ms):", "added_p90_ms"),
              ("P99 added latency (ms):", "added_p99_ms"),
              ("Median bus path added (ms):", "bus_added_median_ms"),
              ("P90 bus path added (ms):", "bus_added_p90_ms")]  # fmt: skip
    for name, title in titles.items():
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for label, key in labels:
            print(f"{label:<40} {r[name][key]:<10.3f}")
    print("=" * 50)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    machine = machine_info()
    with target(args) as server:
        if server.nats_url is None:
            raise SystemExit(
                "no NATS URL: pass --nats-url (or SGLBUS_NATS_URL); the bus API is reached over NATS"
            )
        result = asyncio.run(measure(args, server.base, server.nats_url, server.nats_token))
    print_block(args, result)
    if args.output_file:
        append_result(args.output_file, vars(args), machine, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
