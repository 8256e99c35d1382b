"""How fast `/health` answers while the gateway takes the largest requests it accepts.

A separate process polls `GET /health` back to back the whole time; meanwhile this one sends, one phase
at a time: nothing (the baseline), a text prompt of `--text-mib` MiB, an `input_ids` prompt whose JSON
fills the HTTP body limit, a text prompt just under the context that the gateway must really tokenize,
a bus-API payload of token ids at its limit and one over it. A streaming request runs through every
phase and must finish normally (a blocked event loop used to fail it through the worker watchdog).
Prints /health p50 / p99 / max per phase.

    sglbus bench health-latency --launch-server
    python -m benchmarks.health_latency --base-url http://127.0.0.1:30000 --nats-url nats://127.0.0.1:4222
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import threading
import time
from typing import Any

import httpx
import nats
import orjson

from benchmarks.launch import add_target_args, append_result, machine_info, percentile, target


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_target_args(p, nats=True)
    p.add_argument("--text-mib", type=float, default=8.0, help="size of the long text prompt")
    p.add_argument("--repeat", type=int, default=3, help="requests per phase")
    p.add_argument("--output-file", default=None, help="append one JSONL row")
    return p.parse_args(argv)


def _poll(base: str, stop: Any, out: Any) -> None:
    """(its own process, so the load generator's GIL cannot delay it) GET /health back to back until
    `stop` is set; sends [(start time, latency ms, ok)] to `out`."""
    samples = []
    with httpx.Client(base_url=base, timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            ok = http.get("/health").status_code == 200
            samples.append((t0, (time.perf_counter() - t0) * 1000, ok))
            time.sleep(0.002)
    out.send(samples)


class Poller:
    """The /health poller process; `mark(name)` starts a new phase of the record."""

    def __init__(self, base: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop, (self._recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_poll, args=(base, self.stop, send), daemon=True)
        self.marks: list[tuple[float, str]] = [(0.0, "baseline")]
        self.samples: dict[str, list[float]] = {}
        self.failures = 0

    def start(self) -> None:
        self.proc.start()

    def mark(self, phase: str) -> None:
        self.marks.append((time.perf_counter(), phase))  # perf_counter is system-wide on Linux

    def finish(self) -> None:
        self.stop.set()
        samples = self._recv.recv()
        self.proc.join()
        for t0, ms, ok in samples:
            phase = next(name for start, name in reversed(self.marks) if t0 >= start)
            self.samples.setdefault(phase, []).append(ms)
            self.failures += not ok


def _text(mib: float) -> str:
    words = "the quick brown fox jumps over a lazy dog while it rains in spain ".split()
    out, n, i = [], 0, 0
    while n < mib * (1 << 20):
        w = words[i % len(words)] + " "
        out.append(w)
        n += len(w)
        i += 1
    return "".join(out)


def run(args: argparse.Namespace, base: str, nats_url: str | None, token: str | None) -> dict[str, Any]:
    http = httpx.Client(base_url=base, timeout=300)
    info = http.get("/get_server_info").json()
    body_limit, bus_limit = info["gateway"]["max_body_bytes"], info["gateway"].get("max_bus_request_bytes")
    context = info["context_length"]
    statuses: dict[str, list[int]] = {}
    stream_result: dict[str, Any] = {}

    def streamer() -> None:
        body = {"text": "Tell me a long story.", "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
        last = None
        with httpx.Client(base_url=base, timeout=300) as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = orjson.loads(line[6:])
        stream_result["ok"] = bool(last and "error" not in last and last["meta_info"]["finish_reason"])
        stream_result["last"] = last if not stream_result["ok"] else None

    poller = Poller(base)
    poller.start()
    time.sleep(2.0)
    stream = threading.Thread(target=streamer)
    stream.start()
    ids_per_byte = len(orjson.dumps({"input_ids": [12345] * 1000})) / 1000
    n_ids = int((body_limit - 1024) / ids_per_byte)
    phases = {
        f"text {args.text_mib:g} MiB": orjson.dumps({"text": _text(args.text_mib)}),
        f"input_ids x{n_ids} ({body_limit >> 20} MiB body)": orjson.dumps({"input_ids": [12345] * n_ids}),
        f"text of ~{context - 200} tokens (tokenized)": orjson.dumps(
            {"text": _text(4 * (context - 200) / (1 << 20)), "sampling_params": {"max_new_tokens": 1}}
        ),
    }
    for name, data in phases.items():
        poller.mark(name)
        for _ in range(args.repeat):
            r = http.post("/generate", content=data, headers={"content-type": "application/json"})
            statuses.setdefault(name, []).append(r.status_code)
    if nats_url and bus_limit:
        n_bus = int((bus_limit - 1024) / ids_per_byte)
        bus_phases = {  # the largest payload the bus API parses, then one over its limit (413 unparsed)
            f"bus API input_ids x{n_bus} ({bus_limit >> 20} MiB)": orjson.dumps({"input_ids": [7] * n_bus}),
            f"bus API {(bus_limit >> 20) * 10} MiB payload": b'{"text": "' + b"a" * (bus_limit * 10) + b'"}',
        }

        async def bus() -> None:
            nc = await nats.connect(nats_url, token=token)
            for name, payload in bus_phases.items():
                poller.mark(name)
                for _ in range(args.repeat):
                    msg = await nc.request("sglbus.api.generate", payload, timeout=120)
                    statuses.setdefault(name, []).append(orjson.loads(msg.data)["error"]["code"])
            await nc.close()

        asyncio.run(bus())
    poller.mark("after")
    stream.join()
    time.sleep(1.0)
    poller.finish()
    result: dict[str, Any] = {"health_failures": poller.failures, "stream_ok": stream_result["ok"],
                              "stream_last": stream_result.get("last"), "phases": {}}  # fmt: skip
    for name, ms in poller.samples.items():
        result["phases"][name] = {"probes": len(ms), "p50_ms": percentile(ms, 50),
                                  "p99_ms": percentile(ms, 99), "max_ms": max(ms),
                                  "statuses": statuses.get(name, [])}  # fmt: skip
    return result


def print_block(r: dict[str, Any]) -> None:
    print("\n{s:{c}^{n}}".format(s=" /health while large requests arrive ", n=86, c="="))
    print(f"{'phase':<44} {'probes':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  answers")
    for name, p in r["phases"].items():
        print(f"{name:<44} {p['probes']:>6} {p['p50_ms']:>8.2f} {p['p99_ms']:>8.2f} {p['max_ms']:>8.1f}  "
              f"{p['statuses']}")  # fmt: skip
    print(f"/health failures: {r['health_failures']}; the stream running meanwhile finished normally: "
          f"{r['stream_ok']}")  # fmt: skip
    print("=" * 86)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    machine = machine_info()
    with target(args) as server:
        result = run(args, server.base, server.nats_url, server.nats_token)
    print_block(result)
    if args.output_file:
        append_result(args.output_file, vars(args), machine, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
