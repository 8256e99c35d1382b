"""One abusive client against the gateway (issue 34): each attack should be answered 4xx / 503
within a second, `/health` p99 under 50 ms meanwhile, other clients unaffected, nothing lost, memory
bounded.

A separate process polls `GET /health` back to back (health_latency.Poller); another, the bystander,
runs ordinary requests throughout with its own bearer token (a 200-token stream, and short requests
one after another) and counts each that does not finish normally. This process attacks with another
token, one phase at a time, over raw sockets (an HTTP library's own overhead would hide the server's
answer times), and reads the gateway's VmRSS before and after each phase.

    python -m benchmarks.abuse --launch-server --server-args "--max-inflight-requests 64"
    python -m benchmarks.abuse --base-url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import sys
import time
import urllib.parse
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
import orjson

from benchmarks.health_latency import Poller
from benchmarks.launch import add_target_args, append_result, machine_info, percentile, target
from services.gateway.logprob_options import MAX_TOKEN_IDS_LOGPROB
from shared.grammar_limits import MAX_SCHEMA_NODES
from shared.sampling_params import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_REGEX

BYSTANDER = {"Authorization": "Bearer bystander-key"}
ATTACKER = {"Authorization": "Bearer attacker-key"}
STORY = {"text": "Tell me a long story.", "stream": True,
         "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}}  # fmt: skip
SHORT = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_target_args(p)
    p.add_argument("--flood", type=int, default=200, help="concurrent long requests of the in-flight phase")
    p.add_argument("--slowloris", type=int, default=2000, help="connections of the slowloris phase")
    p.add_argument("--slowloris-s", type=float, default=40.0, help="how long the slowloris phase lasts")
    p.add_argument("--uploads", type=int, default=32, help="parallel uploads of 8 MiB")
    p.add_argument("--upload-s", type=float, default=15.0, help="how long they trickle in, then are dropped")
    p.add_argument("--upload-kib-s", type=int, default=256, help="each upload's rate, KiB/s")
    p.add_argument("--output-file", default=None, help="append one JSONL row per phase")
    return p.parse_args(argv)


def states_bomb(prompts: int = 250_000, n: int = 128) -> bytes:
    """`prompts` one-letter prompts sampled n times each (250,000 x 128: 32 million request states)."""
    return orjson.dumps({"text": ["a"] * prompts, "sampling_params": {"n": n, "max_new_tokens": 1}})


def huge_lists() -> dict[str, tuple[str, bytes, str]]:
    def body(cap: int, sampling: dict[str, Any], **top: Any) -> tuple[str, bytes, str]:
        data = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, **sampling}, **top}
        return "/generate", orjson.dumps(data), f"at most {cap}"

    return {
        "stop x20000": body(MAX_STOP, {"stop": [f"s{i}" for i in range(20_000)]}),
        "stop_regex x5000": body(MAX_STOP_REGEX, {"stop_regex": [f"x{i}y" for i in range(5_000)]}),
        "logit_bias x50000": body(MAX_LOGIT_BIAS, {"logit_bias": {str(i): -1.0 for i in range(50_000)}}),
        "token_ids_logprob x50000": body(
            MAX_TOKEN_IDS_LOGPROB, {}, return_logprob=True, token_ids_logprob=list(range(50_000))
        ),
    }


def dag_schema(levels: int = 40) -> str:
    """Each level refers to the next one twice: 2^levels nodes once expanded, ~5 KB of text."""
    defs: dict[str, Any] = {f"L{i}": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"$ref": f"#/$defs/L{i + 1}"}, "b": {"$ref": f"#/$defs/L{i + 1}"}}}
        for i in range(levels)}  # fmt: skip
    defs[f"L{levels}"] = {"type": "string", "maxLength": 3}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/L0"})


def deep_json(depth: int = 100_000, key: str = "text") -> bytes:
    return b'{"' + key.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"


def grammar_bodies() -> dict[str, tuple[str, bytes, str]]:
    schema = {"text": "Hi", "sampling_params": {"max_new_tokens": 8, "json_schema": dag_schema()}}
    return {
        "json_schema $ref DAG x40": ("/generate", orjson.dumps(schema), f"at most {MAX_SCHEMA_NODES}"),
        "/generate [ x100000": ("/generate", deep_json(), ""),
        "/v1/chat/completions [ x100000": ("/v1/chat/completions", deep_json(key="messages"), ""),
    }


class Raw(NamedTuple):
    host: str
    port: int

    async def call(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] = ATTACKER,
                   timeout: float = 300.0) -> tuple[int | str, dict[str, str], bytes, float]:  # fmt: skip
        """One request on its own connection: (status or why none, headers, body, seconds)."""
        t0 = time.perf_counter()
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nConnection: close\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in {"Content-Type": "application/json", **headers}.items()
        )
        w = None
        try:
            r, w = await asyncio.open_connection(self.host, self.port)
            w.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            data = await asyncio.wait_for(r.read(), timeout)
        except TimeoutError:  # (an OSError too: caught first)
            return "timeout", {}, b"", time.perf_counter() - t0
        except OSError as e:
            return type(e).__name__, {}, b"", time.perf_counter() - t0
        finally:
            if w is not None:
                w.close()
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status: int | str = int(lines[0].split()[1]) if lines[0] else "closed"
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        return status, hdrs, rest, time.perf_counter() - t0

    async def json(self, path: str) -> Any:
        return orjson.loads((await self.call("GET", path))[2])


def last_event(sse: bytes) -> dict[str, Any]:
    """The last `data: {...}` event of an SSE body (orjson escapes newlines: one line per event)."""
    events = re.findall(rb"data: (\{.*\})\n", sse)
    return orjson.loads(events[-1]) if events else {}


@dataclass
class Attack:
    statuses: Counter = field(default_factory=Counter)
    slowest_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, status: int | str, seconds: float) -> None:
        self.statuses[status] += 1
        self.slowest_s = max(self.slowest_s, seconds)

    async def send(self, raw: Raw, path: str, body: bytes, names: str = "", label: str = "") -> None:
        """POST; a 5xx, or an answer without `names` in it, is kept in notes["unexpected"]."""
        status, _, text, s = await raw.call("POST", path, body)
        self.add(status, s)
        if label:
            slowest = self.notes.setdefault("each", {}).get(label, [0, 0.0])[1]
            self.notes["each"][label] = [status, max(slowest, round(s, 3))]
        if not isinstance(status, int) or status >= 500 or names.encode() not in text:
            self.notes.setdefault("unexpected", []).append(f"{status}: {text[:200].decode(errors='replace')}")


def gateway_rss_mib(root: int | None) -> float:
    """VmRSS of the `python -m services.gateway` processes (below `root` when given), from /proc."""
    kib = 0
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:  # not its body_parser / grammar_sandbox child
                if b"services.gateway" not in f.read().split(b"\0"):
                    continue
            pid, seen = int(d), set()
            while root is not None and pid > 1 and pid != root and pid not in seen:
                seen.add(pid)
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent
            if root is None or pid == root:
                with open(f"/proc/{d}/status") as f:
                    kib += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except OSError:
            continue
    return round(kib / 1024, 1)


def _bystand(base: str, stop: Any, out: Any) -> None:
    """Sends [(end time, ok, why)] to `out` once `stop` is set: a stream and short requests."""
    done: list[tuple[float, bool, str]] = []

    def loop(stream: bool) -> None:
        with httpx.Client(base_url=base, timeout=300, headers=BYSTANDER) as c:
            while not stop.is_set():
                try:
                    if stream:
                        with c.stream("POST", "/generate", json=STORY) as r:
                            status, last = r.status_code, last_event(r.read())
                    else:
                        r = c.post("/generate", json=SHORT)
                        status, last = r.status_code, r.json()
                    finish = (last.get("meta_info") or {}).get("finish_reason") or {}
                    ok = status == 200 and finish.get("type") == "length"
                    why = "" if ok else f"HTTP {status} {str(last)[:200]}"
                except (httpx.HTTPError, ValueError) as e:
                    ok, why = False, repr(e)
                done.append((time.perf_counter(), ok, why))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(loop, (True, False)))
    out.send(done)


async def sends(raw: Raw, bodies: dict[str, tuple[str, bytes, str]], repeat: int = 1) -> Attack:
    rec = Attack()
    for label, (path, body, names) in bodies.items():
        for _ in range(repeat):
            await rec.send(raw, path, body, names, label)
    return rec


async def inflight_flood(raw: Raw, n: int, hold_s: float = 5.0) -> Attack:
    """n concurrent long requests: the excess must get a 503 with Retry-After at once; after hold_s the
    accepted ones are aborted (abort_all, the attacker's own token) and must all answer."""
    rec, retry_after, ends = Attack(), Counter(), Counter()

    async def one(i: int) -> None:
        body = {"text": "Write a very long story.", "rid": f"flood-{i}",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}  # fmt: skip
        status, hdrs, text, s = await raw.call("POST", "/generate", orjson.dumps(body))
        if status == 200:
            ends[orjson.loads(text)["meta_info"]["finish_reason"]["type"]] += 1
            rec.statuses["200 accepted"] += 1
        else:
            rec.add(status, s)
            retry_after[hdrs.get("retry-after")] += 1

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.sleep(hold_s)
    rec.notes["in_flight_held"] = (await raw.json("/get_server_info"))["gateway"]["in_flight"]
    other = await raw.call("POST", "/generate", orjson.dumps(SHORT), headers=BYSTANDER)
    rec.notes["another_client_meanwhile"] = [other[0], round(other[3], 3)]
    t0 = time.perf_counter()
    await raw.call("POST", "/abort_request", b'{"abort_all": true}')
    finished, lost = await asyncio.wait(tasks, timeout=120)
    rec.notes.update(accepted_ended=dict(ends), abort_all_to_last_answer_s=round(time.perf_counter() - t0, 2),
                     lost=len(lost), retry_after_on_refusals=dict(retry_after),
                     errors=[repr(t.exception()) for t in finished if t.exception()][:3])  # fmt: skip
    for t in lost:
        t.cancel()
    return rec


async def fresh_health(raw: Raw, rec: Attack, every: float = 1.0) -> None:
    """Until cancelled: GET /health on a new connection every second (can a new client still connect?)."""
    seen: Counter = Counter()
    rec.notes["new_connection_health"] = seen
    while True:
        status, _, _, s = await raw.call("GET", "/health", timeout=10)
        seen[status] += 1
        seen["slowest_s"] = max(seen["slowest_s"], round(s, 3))
        await asyncio.sleep(every)


async def slowloris(raw: Raw, n: int, seconds: float, every: float = 5.0) -> Attack:
    """n connections that send a partial header line, then a byte every `every` s; the server should
    close each (http_protocol.HEADER_TIMEOUT_S). Slowest: the latest close, from its connection's open."""
    rec, end = Attack(), time.perf_counter() + seconds

    async def one() -> None:
        try:
            r, w = await asyncio.open_connection(raw.host, raw.port)
        except OSError as e:
            rec.statuses[f"connect {type(e).__name__}"] += 1
            return
        opened = time.perf_counter()
        w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")

        async def trickle() -> None:
            while True:
                await asyncio.sleep(every)
                w.write(b"a")

        dripping = asyncio.create_task(trickle())
        try:
            data = await asyncio.wait_for(r.read(4096), end - time.perf_counter())
            after = time.perf_counter() - opened
            rec.add("closed by server" if not data else f"answered {data[9:12].decode()}", after)
            rec.notes.setdefault("closed_after_s", []).append(round(after, 1))
        except TimeoutError:  # (an OSError too: caught first)
            rec.statuses["still open at the end"] += 1
        except OSError as e:
            rec.add(type(e).__name__, time.perf_counter() - opened)
        finally:
            dripping.cancel()
            w.close()

    await asyncio.gather(*(one() for _ in range(n)))
    closed = rec.notes.pop("closed_after_s", [])
    rec.notes["closed_after_s_min_max"] = [min(closed, default=None), max(closed, default=None)]
    return rec


async def uploads(raw: Raw, n: int, size: int, seconds: float, rate: int) -> Attack:
    """n bodies of `size` bytes declared, trickled at `rate` bytes/s each for `seconds`, then dropped."""
    rec, chunk, sent = Attack(), b"a" * (rate // 4), [0]
    head = (f"POST /generate HTTP/1.1\r\nHost: {raw.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n" + '{"text": "').encode()  # fmt: skip
    end = time.perf_counter() + seconds

    async def one() -> None:
        r, w = await asyncio.open_connection(raw.host, raw.port)
        t0, mine = time.perf_counter(), len(head)
        w.write(head)
        try:
            while time.perf_counter() < end and mine + len(chunk) < size:
                w.write(chunk)
                mine, sent[0] = mine + len(chunk), sent[0] + len(chunk)
                await w.drain()
                await asyncio.sleep(0.25)
            data = await asyncio.wait_for(r.read(4096), 0.1)
            answer = f"answered {data[9:12].decode()}" if data else "closed by server"
            rec.add(answer, time.perf_counter() - t0)
        except TimeoutError:  # (an OSError too: caught first)
            rec.statuses["no answer yet (dropped)"] += 1
        except OSError as e:
            rec.add(type(e).__name__, time.perf_counter() - t0)
        finally:
            w.close()

    await asyncio.gather(*(one() for _ in range(n)))
    rec.notes["sent_mib"] = round(sent[0] / (1 << 20), 1)
    return rec


async def abort_flood(raw: Raw, aborts: int = 5000, abort_alls: int = 100) -> Attack:
    """Aborts of random rids, abort_all, and aborts of rid "victim", all with the attacker's token,
    while the bystander's token streams with rid "victim": that stream must end by its length."""

    async def victim() -> Any:
        body = orjson.dumps({**STORY, "rid": "victim"})
        status, _, sse, _ = await raw.call("POST", "/generate", body, headers=BYSTANDER)
        return status, (last_event(sse).get("meta_info") or {}).get("finish_reason")

    rec, gate, stream = Attack(), asyncio.Semaphore(32), asyncio.create_task(victim())
    await asyncio.sleep(0.5)
    bodies: list[dict[str, Any]] = []
    for i in range(aborts):
        bodies.append({"rid": uuid.uuid4().hex})
        if i % (aborts // abort_alls) == 0:
            bodies += [{"abort_all": True}, {"rid": "victim"}]

    async def one(b: dict[str, Any]) -> None:
        async with gate:
            await rec.send(raw, "/abort_request", orjson.dumps(b))

    await asyncio.gather(*(one(b) for b in bodies))
    rec.notes["victim_stream"] = await stream
    return rec


async def health_generate_flood(raw: Raw, n: int = 500) -> Attack:
    rec = Attack()
    before = (await raw.json("/get_server_info"))["gateway"]["stats"]["finished"]

    async def one() -> None:
        status, _, _, s = await raw.call("GET", "/health_generate")
        rec.add(status, s)

    await asyncio.gather(*(one() for _ in range(n)))
    after = (await raw.json("/get_server_info"))["gateway"]["stats"]["finished"]
    rec.notes["requests_finished_meanwhile"] = after - before  # the probes' and the bystander's
    return rec


async def attack_phases(args: argparse.Namespace, raw: Raw, mark: Any) -> dict[str, Attack]:
    bomb = {f"{k} prompts x n 128 ({len(b) / (1 << 20):.2f} MiB)": ("/generate", b, "max_request_states")
            for k, b in ((k, states_bomb(k)) for k in (250_000, 275_000))}  # fmt: skip
    phases = {
        "baseline": lambda: asyncio.sleep(5.0, Attack()),
        "250000 prompts x n 128": lambda: sends(raw, bomb, repeat=2),
        f"{args.flood} concurrent long": lambda: inflight_flood(raw, args.flood),
        "huge lists": lambda: sends(raw, huge_lists()),
        "$ref DAG, deep JSON": lambda: sends(raw, grammar_bodies()),
        f"slowloris x{args.slowloris}": lambda: slowloris(raw, args.slowloris, args.slowloris_s),
        f"{args.uploads} uploads of 8 MiB": lambda: uploads(
            raw, args.uploads, 8 << 20, args.upload_s, args.upload_kib_s << 10
        ),
        "abort flood": lambda: abort_flood(raw),
        "/health_generate x500": lambda: health_generate_flood(raw),
    }
    out: dict[str, Attack] = {}
    for name, attack in phases.items():
        rss0 = gateway_rss_mib(args.root_pid)
        mark(name)
        print(f"phase: {name}", flush=True)
        probe_rec = Attack()
        probe = asyncio.create_task(fresh_health(raw, probe_rec))
        rec = await attack()
        probe.cancel()
        rec.notes.update(probe_rec.notes, rss_mib=[rss0, gateway_rss_mib(args.root_pid)])
        out[name] = rec
        await asyncio.sleep(1.0)
    return out


def run(args: argparse.Namespace, base: str) -> list[dict[str, Any]]:
    u = urllib.parse.urlsplit(base)
    raw = Raw(u.hostname or "127.0.0.1", u.port or 80)
    poller = Poller(base)
    ctx = multiprocessing.get_context("spawn")
    stop, (recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
    bystander = ctx.Process(target=_bystand, args=(base, stop, send), daemon=True)
    poller.start()
    bystander.start()
    time.sleep(2.0)
    attacks = asyncio.run(attack_phases(args, raw, poller.mark))
    poller.mark("after")
    stop.set()
    done = recv.recv()
    bystander.join()
    poller.finish()
    in_flight = httpx.get(f"{base}/get_server_info").json()["gateway"]["in_flight"]
    rows = []
    for name, rec in attacks.items():
        ms = poller.samples.get(name, [])
        mine = [d for d in done if next(p for t, p in reversed(poller.marks) if d[0] >= t) == name]
        health = [round(percentile(ms, q), 2) for q in (50, 99)] + [round(max(ms, default=0), 1)]
        rows.append({"phase": name, "statuses": {str(k): v for k, v in rec.statuses.items()},
                     "slowest_s": round(rec.slowest_s, 3), "health_probes": len(ms), "health_ms": health,
                     "bystander_ok_failed": [sum(d[1] for d in mine), sum(not d[1] for d in mine)],
                     "bystander_failures": [d[2] for d in mine if not d[1]][:3],
                     "health_failures_all_run": poller.failures, "in_flight_at_end": in_flight,
                     **rec.notes})  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n{s:{c}^{n}}".format(s=" one abusive client (issue 34) ", n=132, c="="))
    print(f"{'phase':<24} {'attacker got':<38} {'slowest s':>9} {'/health p50 p99 max ms':>23} "
          f"{'bystander ok/fail':>17} {'RSS MiB':>15}")  # fmt: skip
    table = {"phase", "statuses", "slowest_s", "health_probes", "health_ms", "bystander_ok_failed", "rss_mib",
             "health_failures_all_run", "in_flight_at_end"}  # fmt: skip
    for r in rows:
        got = " ".join(f"{k}x{v}" for k, v in r["statuses"].items()) or "-"
        (p50, p99, top), (ok, failed) = r["health_ms"], r["bystander_ok_failed"]
        print(f"{r['phase']:<24} {got[:38]:<38} {r['slowest_s']:>9.3f} {p50:>7.2f} {p99:>7.2f} {top:>7.1f} "
              f"{ok:>12}/{failed:<4} {r['rss_mib'][0]:>7}→{r['rss_mib'][1]:<7}")  # fmt: skip
        if extra := {k: v for k, v in r.items() if k not in table and v not in ([], {}, None)}:
            print(f"{'':<24} {json.dumps(extra, default=str)[:400]}")
    print(f"/health probes failed (whole run): {rows[-1]['health_failures_all_run']}; gateway requests in "
          f"flight at the end: {rows[-1]['in_flight_at_end']}")  # fmt: skip
    print("=" * 132)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    machine = machine_info()
    with target(args) as server:
        args.root_pid = server.pid
        rows = run(args, server.base)
        machine["loadavg_1m_at_end"] = os.getloadavg()[0]
    print_table(rows)
    if args.output_file:
        for row in rows:
            append_result(args.output_file, vars(args), machine, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
