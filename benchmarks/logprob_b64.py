"""Flat prompt top-logprob arrays as JSON number lists vs base64 (upstream SGLang PR #31960's benchmark).

The gateway receives a request's prompt top-k logprobs from the bus as numpy arrays (float32 values,
sorted descending per row; int32 token ids). For each format this times
  server: `flat_top_fields` + a meta_info-like response dict + serialisation to bytes, with orjson (what
          the gateway uses) and with the stdlib's json.dumps (what upstream measured);
  client: stdlib json.loads of the gateway's (orjson) bytes + conversion to (rows, k) numpy arrays
          (np.asarray of the lists for the flat form, `decode_flat_b64` for base64);
best of --repeats each. The first prompt position is a null (nothing precedes it), so rows = positions - 1.
Round trip = server + client. No server, no model: this is the serialisation cost alone.

    sglbus bench logprob-b64
    python -m benchmarks.logprob_b64 --positions 32768 --k 2 --repeats 5
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from benchmarks.launch import append_result, machine_info

PREFIX = "input_top_logprobs"
NULL_PREFIX = 1


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--positions", type=int, default=32768, help="prompt positions (rows = positions - 1)")
    p.add_argument("--k", type=int, default=2, help="top logprobs per position")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the best counts")
    p.add_argument("--vocab-size", type=int, default=151936, help="token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stdlib-base64",
        action="store_true",
        help="use the stdlib base64 even with pybase64 installed",
    )
    p.add_argument("--output-file", default=None, help="append one JSONL row")
    return p.parse_args(argv)


def make_arrays(rows: int, k: int, vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random logprobs (full float32 mantissas, sorted descending per row) and ids, as the bus delivers."""
    rng = np.random.default_rng(seed)
    vals = -np.sort(rng.exponential(2.0, (rows, k)).astype(np.float32), axis=1)
    idx = rng.integers(0, vocab_size, (rows, k), dtype=np.int32)
    return vals, idx


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def measure(args: argparse.Namespace, lf: Any) -> dict[str, Any]:
    rows = args.positions - NULL_PREFIX
    vals, idx = make_arrays(rows, args.k, args.vocab_size, args.seed)

    def response(b64: bool) -> dict[str, Any]:
        fields = lf.flat_top_fields(PREFIX, vals, idx, NULL_PREFIX, b64)
        meta = {"id": "bench", "prompt_tokens": args.positions, "completion_tokens": 1, **fields}
        return {"text": " the", "meta_info": meta}

    result: dict[str, Any] = {"rows": rows, "base64_module": lf.BASE64_MODULE}
    for name, b64 in (("flat", False), ("b64", True)):
        decode = lf.decode_flat_b64 if b64 else lf.decode_flat
        body = orjson.dumps(response(b64))
        body_json = json.dumps(response(b64)).encode()
        # check once, untimed: the client gets back exactly the float32 values and ids
        got_v, got_i = decode(json.loads(body)["meta_info"], PREFIX)
        if got_v.tobytes() != vals.tobytes() or not np.array_equal(got_i, idx):
            raise RuntimeError(f"{name}: decoded arrays differ from the originals")
        server_orjson = best_ms(lambda b64=b64: orjson.dumps(response(b64)), args.repeats)
        server_json = best_ms(lambda b64=b64: json.dumps(response(b64)).encode(), args.repeats)
        client = best_ms(
            lambda body=body, decode=decode: decode(json.loads(body)["meta_info"], PREFIX), args.repeats
        )
        result[name] = {
            "server_orjson_ms": server_orjson,
            "server_json_ms": server_json,
            "client_ms": client,
            "round_trip_orjson_ms": server_orjson + client,
            "round_trip_json_ms": server_json + client,
            "payload_orjson_bytes": len(body),
            "payload_json_bytes": len(body_json),
        }
    flat, b64 = result["flat"], result["b64"]
    result["speedup_orjson"] = flat["round_trip_orjson_ms"] / b64["round_trip_orjson_ms"]
    result["speedup_json"] = flat["round_trip_json_ms"] / b64["round_trip_json_ms"]
    result["payload_fraction_orjson"] = b64["payload_orjson_bytes"] / flat["payload_orjson_bytes"]
    result["payload_fraction_json"] = b64["payload_json_bytes"] / flat["payload_json_bytes"]
    return result


def print_block(args: argparse.Namespace, r: dict[str, Any]) -> None:
    line = "{:<40} {:<10}".format
    print("\n{s:{c}^{n}}".format(s=" Flat Top Logprobs Benchmark Result ", n=50, c="="))
    print(line("Prompt positions / rows / k:", f"{args.positions} / {r['rows']} / {args.k}"))
    print(line("Base64 module:", r["base64_module"]))
    labels = [
        ("Server build + orjson.dumps (ms):", "server_orjson_ms"),
        ("Server build + json.dumps (ms):", "server_json_ms"),
        ("Client json.loads + to numpy (ms):", "client_ms"),
        ("Round trip, orjson server (ms):", "round_trip_orjson_ms"),
        ("Round trip, json.dumps server (ms):", "round_trip_json_ms"),
        ("Payload, orjson (bytes):", "payload_orjson_bytes"),
        ("Payload, json.dumps (bytes):", "payload_json_bytes"),
    ]
    for name, title in (("flat", "Flat lists"), ("b64", "Base64")):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for label, key in labels:
            value = r[name][key]
            print(line(label, f"{value:,}" if isinstance(value, int) else f"{value:.2f}"))
    print("{s:{c}^{n}}".format(s="Base64 vs flat lists", n=50, c="-"))
    print(line("Round-trip speedup, orjson server:", f"{r['speedup_orjson']:.2f}x"))
    print(line("Round-trip speedup, json.dumps server:", f"{r['speedup_json']:.2f}x"))
    print(line("Payload fraction, orjson:", f"{r['payload_fraction_orjson']:.3f}"))
    print(line("Payload fraction, json.dumps:", f"{r['payload_fraction_json']:.3f}"))
    print("=" * 50)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    if args.positions < 1 or args.k < 0 or args.repeats < 1:
        raise SystemExit("--positions and --repeats must be >= 1, --k >= 0")
    machine = machine_info()
    if args.stdlib_base64:
        sys.modules["pybase64"] = None  # makes `import pybase64` fail, so the module takes the stdlib
    lf = importlib.import_module("services.gateway.logprob_fields")
    if args.stdlib_base64 and lf.BASE64_MODULE != "base64":
        lf = importlib.reload(lf)
    result = measure(args, lf)
    print_block(args, result)
    if args.output_file:
        append_result(args.output_file, vars(args), machine, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
