"""Faults with real processes, on servers of their own: NATS restarting under the services, and a
worker dying while requests are in flight (clients get an error within the liveness timeout instead of
hanging, and the scheduler's KV stays consistent)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import nats
import nats.errors
import pytest
from conftest import ServerProcs, start_server
from it_helpers import PROMPT, generate, greedy, same_output

WORKER_TIMEOUT_S = 2.0  # the gateway's liveness timeout where workers get killed
NATS_TESTS_WORKER_TIMEOUT_S = 5.0  # a short NATS outage must not count as a dead worker
LONG = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}

pytestmark = pytest.mark.slow


def _own_server(worker_timeout: float) -> Iterator[ServerProcs]:
    s = start_server(env={"SGLBUS_WORKER_TIMEOUT": str(worker_timeout)})
    try:
        yield s
    finally:
        s.stop()


# one server for the NATS restarts and one for the killed worker: a start costs ~20 s on 2 cores
@pytest.fixture(scope="module")
def nats_restarts() -> Iterator[ServerProcs]:
    yield from _own_server(NATS_TESTS_WORKER_TIMEOUT_S)


@pytest.fixture(scope="module")
def worker_deaths() -> Iterator[ServerProcs]:
    yield from _own_server(WORKER_TIMEOUT_S)


def wait_until(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(poll)


def running(s: ServerProcs) -> int | None:
    """The scheduler's running requests; None while it does not answer (reconnecting)."""
    r = s.http.get("/get_server_info")
    return r.json()["num_running_reqs"] if r.status_code == 200 else None


def abort(s: ServerProcs, rids: list[str]) -> None:
    for rid in rids:
        s.http.post("/abort_request", json={"rid": rid})


# -- NATS restarts ---------------------------------------------------------------------------------
def test_nats_restart_services_reconnect(nats_restarts):
    s = nats_restarts
    body = {"text": PROMPT, "sampling_params": greedy(6, ignore_eos=True)}
    ref = generate(s.http, body)
    s.restart_nats(downtime=1.0)
    tried: list[str] = []

    def served() -> bool:
        tried.append(rid := f"after-restart-{len(tried)}")
        r = s.http.post("/generate", json={**body, "rid": rid}, timeout=5)
        return r.status_code == 200 and same_output(r.json(), ref)

    try:
        wait_until(served, 20, "a request served after the NATS restart", poll=0.5)
    finally:
        abort(s, tried)
    assert s.http.get("/health").status_code == 200
    assert all(p.poll() is None for p in s.procs.values())
    # not the gateway's count: an attempt the bus dropped while reconnecting stays there forever
    # (test_request_lost_by_the_bus_gets_an_answer)
    s.wait_idle(timeout=20, gateway=False)
    s.integrity()


def test_nats_restart_mid_request_loses_no_tokens(nats_restarts):
    """A request in flight while NATS restarts either fails with an error or returns exactly the
    right output; a 200 with tokens missing from the middle is silent corruption.

    NATS is at-most-once: what the scheduler publishes after it reconnects, before its detokenizer
    has resubscribed, is dropped. That happens by chance (seen in about 1 run in 3 with a plain
    restart); pausing the detokenizer (SIGSTOP) across the restart, for less than the liveness
    timeout, makes it happen every time."""
    s = nats_restarts
    body = {"text": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 120}}
    ref = generate(s.http, body)
    detok = s.procs["detokenizer"]
    with httpx.Client(base_url=s.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http.post, "/generate", json={**body, "rid": "mid-restart"})
        wait_until(lambda: s.info()["num_running_reqs"] == 1, 10, "the request running", poll=0.05)
        time.sleep(0.3)
        detok.send_signal(signal.SIGSTOP)
        try:
            s.restart_nats()
            wait_until(lambda: running(s) == 1, 5, "the scheduler back on the bus", 0.05)
            time.sleep(0.3)  # the scheduler publishes steps that nobody receives
        finally:
            detok.send_signal(signal.SIGCONT)
        try:
            r = fut.result(timeout=40)
        finally:
            abort(s, ["mid-restart"])
    if r.status_code == 200:
        out = r.json()
        got, want = out["output_ids"], ref["output_ids"]
        first = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), 120)
        )
        assert same_output(out, ref), (
            f"200 with {len(got)} of {len(want)} tokens (finish_reason {out['meta_info']['finish_reason']}); "
            f"the output departs from the reference at token {first}"
        )
    else:
        assert r.status_code in (500, 503) and r.json()["error"]["message"], r.text
    s.wait_idle(timeout=20, gateway=False)
    s.integrity()


def test_request_lost_by_the_bus_gets_an_answer(nats_restarts):
    """NATS is at-most-once: a request published while the scheduler has not yet resubscribed after
    a NATS restart is dropped by the server. The client must get an answer (an error is fine) in
    bounded time, not wait forever while every heartbeat says the pipeline is alive.

    Deterministic version of a race seen in the reconnect test: the scheduler is paused (SIGSTOP)
    across the restart, for less than the liveness timeout, so it resubscribes late."""
    s = nats_restarts
    sched = s.procs["scheduler"]
    rid = f"lost-{uuid.uuid4().hex[:8]}"
    body = {"text": PROMPT, "rid": rid, "sampling_params": greedy(2)}
    with httpx.Client(base_url=s.url, timeout=15) as http, ThreadPoolExecutor(1) as pool:
        sched.send_signal(signal.SIGSTOP)
        try:
            s.restart_nats()
            asyncio.run(wait_for_bus_api(s.nats_url))  # the gateway is back on the bus
            fut = pool.submit(http.post, "/generate", json=body)
            time.sleep(0.3)  # published by the gateway to a subject nobody listens on yet
        finally:
            sched.send_signal(signal.SIGCONT)
        try:
            r = fut.result(timeout=30)
        except httpx.ReadTimeout:
            r, info = None, s.info()
        finally:
            abort(s, [rid])
    assert r is not None, (
        f"no answer in 15 s to a request the bus dropped: the scheduler runs "
        f"{info['num_running_reqs']} and queues {info['num_queue_reqs']} requests, the gateway still "
        f"waits on {info['gateway']['in_flight']}"
    )
    assert r.status_code == 200 or r.status_code >= 500, r.text


async def wait_for_bus_api(url: str, timeout: float = 10) -> None:
    """Until a gateway answers on the bus API (a bad request gets a 400 error reply)."""
    nc = await nats.connect(url, name="test-probe")
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await nc.request("sglbus.api.generate", b"", timeout=0.3)
                return
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                assert time.monotonic() < deadline, "the gateway did not come back on the bus"
                await asyncio.sleep(0.05)
    finally:
        await nc.close()


# -- a worker dies -----------------------------------------------------------------------------------
def read_stream(url: str, body: dict[str, Any], started: threading.Event) -> tuple[list[str], float]:
    """A streaming request: its data payloads, and when the stream ended."""
    payloads = []
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    payloads.append(line.removeprefix("data: "))
                    if len(payloads) == 2:
                        started.set()
    return payloads, time.monotonic()


def post_json(url: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/generate", json=body)
    return r, time.monotonic()


def test_detokenizer_killed_mid_request_fails_clients_fast(worker_deaths):
    s = worker_deaths
    rids = ["doomed-stream", "doomed-json"]
    streaming = threading.Event()
    try:
        with ThreadPoolExecutor(2) as pool:
            stream_fut = pool.submit(
                read_stream, s.url, {"text": PROMPT, "sampling_params": LONG, "rid": rids[0]}, streaming
            )
            json_fut = pool.submit(
                post_json, s.url, {"text": "Once upon a time", "sampling_params": LONG, "rid": rids[1]}
            )
            assert streaming.wait(30), "the stream never started"
            wait_until(lambda: s.info()["num_running_reqs"] == 2, 10, "both requests running", poll=0.05)
            s.kill("detokenizer")
            killed = time.monotonic()
            payloads, stream_end = stream_fut.result(timeout=60)
            r, json_end = json_fut.result(timeout=60)

        limit = WORKER_TIMEOUT_S + 5
        # the stream: chunks, then one error event, then [DONE]
        assert payloads[-1] == "[DONE]"
        err = json.loads(payloads[-2])
        assert set(err) == {"error"} and "detokenizer" in err["error"]["message"], err
        assert all("text" in json.loads(p) for p in payloads[:-2])
        assert stream_end - killed < limit
        # the JSON request: a 5xx with a JSON error naming the problem
        assert 500 <= r.status_code < 600, (r.status_code, r.text)
        assert "detokenizer" in r.json()["error"]["message"]
        assert json_end - killed < limit
        assert s.http.get("/health").status_code == 503
        assert s.http.get("/health_generate").status_code == 503
        # the gateway gave up on those requests: the scheduler must stop them and give back their KV
        stopped = lambda: s.info()["num_running_reqs"] == 0
        wait_until(stopped, 10, "the scheduler dropping the requests the gateway failed")
        info = s.integrity()
        assert info["stats"]["generated_tokens"] < 1000
    finally:
        abort(s, rids)


def test_detokenizer_restart_recovers(worker_deaths):
    s = worker_deaths
    if s.procs["detokenizer"].poll() is None:
        s.kill("detokenizer")
    wait_until(lambda: s.http.get("/health").status_code == 503, WORKER_TIMEOUT_S + 5, "/health 503")
    s.start("detokenizer")
    wait_until(lambda: s.http.get("/health").status_code == 200, 60, "/health 200 after the restart")
    body = {"text": PROMPT, "sampling_params": greedy(4, ignore_eos=True)}
    out = generate(s.http, body)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    s.wait_idle(timeout=20)
    s.integrity()
