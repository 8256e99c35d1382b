"""`sglbus serve` as a user runs it: one process that starts NATS and the three services, gives each
role its own NATS user (a bus-API client gets the bus-api one, which may only ask the API), restarts
what dies or hangs, drains and stops in order on Ctrl-C / SIGTERM, and refuses a bad model in one line.

One served instance is shared by the module and the tests run in file order: the last one stops it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import nats
import orjson
import psutil
import pytest
from conftest import ROOT

from shared.model_files import cache_root
from shared.nats_server import free_port

START_TIMEOUT_S = 300.0
# the target: service back without an operator within 30 s of a kill -9 (about 15 s measured
# on an idle 2-core box, most of it the scheduler's torch import and model load)
RESTORE_TIMEOUT_S = 30.0
API_KEY = "test-api-key"
SERVICES = ("gateway", "scheduler", "detokenizer")
GATEWAYS = 2
# the watchdog of the shared instance: well above any step of these tests' small requests, even on a
# busy 2-core box (a 2048-token prefill takes ~4 s on two idle cores)
WATCHDOG_S = 10.0
DRAIN_S = 10.0  # --shutdown-timeout of the drain test
LONG = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}  # never done within DRAIN_S on CPU


def private_cache() -> str:
    """A cache dir of our own (the bus-api password file lands there) that reuses the converted default model:
    links to the shared conversions, so whatever a test converts stays in its own folder."""
    path = tempfile.mkdtemp(prefix="sglbus-serve-test-")
    shared = os.path.join(cache_root(), "gguf")
    os.mkdir(os.path.join(path, "gguf"))
    for name in os.listdir(shared) if os.path.isdir(shared) else []:
        if not name.endswith(".lock"):
            os.symlink(os.path.join(shared, name), os.path.join(path, "gguf", name))
    return path


class Served:
    """`python -m sglbus.cli serve` in a session of its own (as a terminal's foreground job), stdout
    and stderr kept apart."""

    def __init__(self, cache: str, args: list[str] = (), env: dict[str, str] | None = None) -> None:
        self.cache, self.port, self.nats_port = cache, free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out_path, self.err_path = os.path.join(cache, "serve.out"), os.path.join(cache, "serve.err")
        cmd = [sys.executable, "-m", "sglbus.cli", "serve", "--port", str(self.port), "--nats-port",
               str(self.nats_port), "--max-total-tokens", "16384", *args]  # fmt: skip
        env = {**os.environ, "SGLBUS_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, start_new_session=True)  # fmt: skip
        self.http = httpx.Client(
            base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        )

    def out(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def err(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "sglbus is serving at" not in self.out():
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}\n{self.err()[-3000:]}"
            assert time.monotonic() < deadline, f"not serving after {START_TIMEOUT_S} s\n{self.err()[-3000:]}"
            time.sleep(0.3)

    def children(self, name: str) -> list[psutil.Process]:
        out = []
        for p in psutil.Process(self.proc.pid).children():
            with_args = " ".join(p.cmdline())
            if (name == "nats-server" and p.name() == "nats-server") or f"services.{name}" in with_args:
                out.append(p)
        return out

    def child(self, name: str) -> psutil.Process:
        found = self.children(name)
        if not found:
            raise LookupError(f"no {name} child of serve")
        return found[0]

    def generate(self) -> httpx.Response:
        body = {
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        }
        return self.http.post("/generate", json=body)

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    cache = private_cache()
    # two gateways behind the port, as on a GPU host (the default there: one per 8 cores)
    args = ["--tokenizer-worker-num", str(GATEWAYS), "--watchdog-timeout", str(WATCHDOG_S)]
    s = Served(cache, args=args, env={"SGLBUS_API_KEY": API_KEY})
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()
        shutil.rmtree(cache, ignore_errors=True)


def password_path(s: Served) -> str:
    """The bus-api password file of a server on a port other than 4222 (sglbus.serve.password_file)."""
    return os.path.join(s.cache, f"nats-bus-api-password-{s.nats_port}")


def password_of(s: Served) -> str:
    with open(password_path(s)) as f:
        return f.read().strip()


def wait_until(cond: Callable[[], Any], timeout: float, what: str) -> float:
    """Seconds until cond() was true; fails after `timeout`."""
    t0 = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - t0
        except (httpx.HTTPError, psutil.Error, LookupError):
            pass
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.25)


# -- what serve prints and writes ----------------------------------------------------------------------
@pytest.mark.slow
def test_prints_the_bus_url_and_a_private_password_file(served: Served) -> None:
    path = password_path(served)
    line = f"embedded NATS (JetStream on) at nats://127.0.0.1:{served.nats_port} (bus clients: user bus-api, "
    assert line in served.out() and path in served.out(), served.out()
    assert os.stat(path).st_mode & 0o777 == 0o600
    password = password_of(served)
    assert len(password) >= 16
    # secrets travel in the environment, not on command lines (`ps` shows those to every user); each
    # service connects as its own role, never as the bus API
    for p in psutil.Process(served.proc.pid).children():
        assert password not in " ".join(p.cmdline()) and API_KEY not in " ".join(p.cmdline())
        if p.name() != "nats-server":
            role = next(name for name in SERVICES if f"services.{name}" in " ".join(p.cmdline()))
            env = p.environ()
            assert env["SGLBUS_NATS_USER"] == role and env["SGLBUS_NATS_PASSWORD"] != password


@pytest.mark.slow
def test_http_needs_the_api_key_but_health_does_not(served: Served) -> None:
    # once serve printed its URL every gateway behind the port is ready: fresh connections (the kernel
    # spreads them over the gateways) all get 200, none a 503 from a gateway still starting
    for _ in range(4 * GATEWAYS):
        assert httpx.get(served.url + "/health", timeout=60).status_code == 200
    bare = httpx.Client(base_url=served.url, timeout=60)
    try:
        assert bare.get("/health").status_code == 200
        r = bare.post("/generate", json={"text": "hi"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    finally:
        bare.close()
    r = served.generate()
    assert r.status_code == 200, r.text


async def _silent(e: Exception) -> None:
    pass


async def bus_generate(url: str, password: str | None, user: str = "bus-api") -> str:
    login = {"user": user, "password": password} if password else {}
    nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5,
                            error_cb=_silent, **login)  # fmt: skip
    try:
        body = {
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        }
        msg = await nc.request("sglbus.api.generate", orjson.dumps(body), timeout=60)
        return orjson.loads(msg.data)["text"]
    finally:
        await nc.close()


@pytest.mark.slow
def test_the_bus_needs_the_bus_api_password(served: Served) -> None:
    url = f"nats://127.0.0.1:{served.nats_port}"
    for wrong in (None, "not-the-password"):
        with pytest.raises(Exception, match="Authorization Violation"):
            asyncio.run(bus_generate(url, wrong))
    with pytest.raises(Exception, match="Authorization Violation"):  # its password is no other role's
        asyncio.run(bus_generate(url, password_of(served), user="gateway"))
    assert asyncio.run(bus_generate(url, password_of(served)))
    # every service did its job as its own role: no permission was missing (tests/integration/
    # test_nats_permissions.py tries what the bus-api user may not do)
    assert "permissions violation" not in served.err().lower(), served.err()[-3000:]


def requests_total(served: Served) -> float:
    """sglang:num_requests_total as one scrape shows it (a new connection: any of the gateways)."""
    with httpx.Client(base_url=served.url, timeout=60, headers=served.http.headers) as http:
        r = http.get("/metrics")
    assert r.status_code == 200, r.text
    line = [x for x in r.text.splitlines() if x.startswith("sglang:num_requests_total{")]
    return sum(float(x.rsplit(" ", 1)[1]) for x in line)


def settled_requests_total(served: Served) -> float:
    """The count once 8 scrapes in a row (over new connections, so over both gateways) agree."""
    totals: list[float] = []

    def agree() -> bool:
        totals.append(requests_total(served))
        return len(totals) >= 8 and len(set(totals[-8:])) == 1

    wait_until(agree, 30, "scrapes of every gateway agreeing on sglang:num_requests_total")
    return totals[-1]


@pytest.mark.slow
def test_the_gateways_share_the_port_and_count_every_request(served: Served) -> None:
    gateways = served.children("gateway")
    assert len(gateways) == GATEWAYS
    before = settled_requests_total(served)
    clients = [httpx.Client(base_url=served.url, timeout=60, headers=served.http.headers) for _ in range(24)]
    try:
        for http in clients:  # 24 connections: the kernel spreads them over the gateways' sockets
            r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 200, r.text
        held = {g.pid: sum(c.laddr.port == served.port and c.status == psutil.CONN_ESTABLISHED
                           for c in g.net_connections("tcp")) for g in gateways}  # fmt: skip
        assert all(held.values()), f"a gateway got none of the 24 connections: {held}"
    finally:
        for http in clients:
            http.close()
    # each gateway counted only its own share; a scrape of either one shows them all (heartbeats)
    assert settled_requests_total(served) == before + 24


# -- restarts ------------------------------------------------------------------------------------------
def killed_and_restored(served: Served, name: str) -> float:
    old = served.child(name)
    old.kill()
    old.wait(30)
    took = wait_until(lambda: served.generate().status_code == 200, RESTORE_TIMEOUT_S,
                      f"/generate after kill -9 of {name}")  # fmt: skip
    assert served.child(name).pid != old.pid
    assert re.search(rf"{name} exited \(killed by SIGKILL\) after \d+ s; restarting it", served.err())
    return took


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scheduler", "detokenizer", "gateway"])
def test_a_killed_service_is_restarted(served: Served, name: str) -> None:
    killed_and_restored(served, name)
    assert served.proc.poll() is None


@pytest.mark.slow
def test_a_killed_nats_server_is_restarted_on_its_port_with_its_users(served: Served) -> None:
    killed_and_restored(served, "nats-server")
    assert asyncio.run(bus_generate(f"nats://127.0.0.1:{served.nats_port}", password_of(served)))


def read_sse(
    http: httpx.Client, path: str, body: dict[str, Any], first: threading.Event
) -> list[tuple[float, str]]:
    """A streamed request: each data payload with when it arrived; `first` is set at the first."""
    out = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                out.append((time.monotonic(), line.removeprefix("data: ")))
                first.set()
    return out


@pytest.mark.slow
def test_a_hung_scheduler_is_killed_and_restarted(served: Served) -> None:
    """kill -STOP: the scheduler is alive but nothing moves. A stream it was running ends with an error
    naming it (the gateway's liveness window); the watchdog kills it after --watchdog-timeout and it is
    restarted as after a crash (what it held goes back to the work queue: kill -9 in
    test_resilience.py), and the server serves again."""
    old = served.child("scheduler")
    streaming = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(read_sse, served.http, "/generate", {"text": "Hi", "sampling_params": LONG},
                             streaming)  # fmt: skip
        assert streaming.wait(60), "the stream never started"
        old.suspend()
        payloads = [p for _, p in stream.result(timeout=120)]
    assert payloads[-1] == "[DONE]"
    error = orjson.loads(payloads[-2])["error"]
    assert "scheduler" in error["message"] and error["code"] == 503, error
    wait_until(lambda: served.child("scheduler").pid != old.pid, WATCHDOG_S + 60, "a new scheduler")
    wait_until(lambda: served.generate().status_code == 200, 120, "/generate after the restart")
    assert re.search(r"scheduler \(pid \d+\) sent no watchdog beat for \d+ s .*: killing it", served.err())
    assert re.search(r"scheduler exited \(killed by SIGKILL\) after \d+ s; restarting it", served.err())
    assert served.proc.poll() is None


# -- stopping ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_stops_in_order() -> None:
    """SIGTERM under load: new requests get a 503 saying why; a request that finishes within
    --shutdown-timeout completes; those still running then end with an error naming the drain (JSON:
    an error body; SGLang and OpenAI streams: an error event, then [DONE]) instead of a dropped
    connection; then the pipeline and NATS stop, in that order, and serve exits 0."""
    cache = private_cache()
    s = Served(cache, args=["--tokenizer-worker-num", "1", "--shutdown-timeout", str(DRAIN_S)])
    try:
        s.wait_serving()
        started = [threading.Event() for _ in range(3)]
        oai = {"model": "default", "prompt": "Once upon a time", **LONG, "max_tokens": 2000}
        del oai["max_new_tokens"]
        with ThreadPoolExecutor(4) as pool:
            long_stream = pool.submit(read_sse, s.http, "/generate", {"text": "Hi", "sampling_params": LONG},
                                      started[0])  # fmt: skip
            oai_stream = pool.submit(read_sse, s.http, "/v1/completions", oai, started[1])
            long_json = pool.submit(s.http.post, "/generate", json={"text": "Hello", "sampling_params": LONG})
            assert started[0].wait(60) and started[1].wait(60), "the streams never started"
            short = {"text": "Say something.", "sampling_params": {**LONG, "max_new_tokens": 24}}
            short_stream = pool.submit(read_sse, s.http, "/generate", short, started[2])
            assert started[2].wait(60), "the short stream never started"
            wait_until(lambda: s.http.get("/get_server_info").json()["num_running_reqs"] == 4, 30,
                       "all four requests running")  # fmt: skip
            term = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            while (health := httpx.get(s.url + "/health", timeout=10)).status_code == 200:
                assert time.monotonic() - term < 60, "/health still 200 a minute after SIGTERM"
                time.sleep(0.1)
            new = s.http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
            assert new.status_code == 503 and "shutting down" in new.json()["error"]["message"], new.text
            short_out, long_out = short_stream.result(60), long_stream.result(60)
            oai_out, json_out = oai_stream.result(60), long_json.result(60)
        assert s.proc.wait(60) == 0
        log = s.err()
    finally:
        s.stop()
        shutil.rmtree(cache, ignore_errors=True)
    assert "shutting down" in health.json()["error"]["message"], health.text
    # the short request was running when the drain began, and finished normally
    assert any(t > term for t, _ in short_out[:-1]), "the short request ended before the drain began"
    assert short_out[-1][1] == "[DONE]"
    last = orjson.loads(short_out[-2][1])
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 24
    # the others were ended by the drain's deadline, each in its API's error shape
    assert json_out.status_code == 503 and "drain" in json_out.json()["error"]["message"], json_out.text
    for out in (long_out, oai_out):
        assert out[-1][1] == "[DONE]"
        error = orjson.loads(out[-2][1])["error"]
        assert "shutting down" in error["message"] and "drain" in error["message"], error
    assert orjson.loads(oai_out[-2][1])["error"]["type"] == "service_unavailable_error"
    steps = ["stopping gateway\n", "stopping scheduler, detokenizer", "stopping nats-server"]
    at = [log.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), log[-3000:]
    assert "did not stop: killing it" not in log, log[-3000:]


@pytest.mark.slow
def test_ctrl_c_stops_everything_in_order_and_quietly(served: Served) -> None:
    children = psutil.Process(served.proc.pid).children()
    assert len(children) == 3 + GATEWAYS
    before = len(served.err())
    os.killpg(served.proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    assert served.proc.wait(60) == 0
    assert not os.path.exists(password_path(served))  # its password went with it
    log = served.err()[before:]
    steps = ["stopping gateway, gateway\n", "stopping scheduler, detokenizer", "stopping nats-server"]
    at = [log.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), log
    warnings = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    assert len(warnings) <= 3, "\n".join(warnings)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive


# -- refusing to start ---------------------------------------------------------------------------------
def run_serve(
    args: list[str], timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cache = private_cache()
    try:
        cmd = [sys.executable, "-m", "sglbus.cli", "serve", "--port", str(free_port()), *args]
        env = {**os.environ, **(env or {}), "SGLBUS_CACHE_DIR": cache}
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture
def bad_gguf() -> Iterator[str]:
    fd, path = tempfile.mkstemp(suffix=".gguf")
    os.write(fd, b"not a gguf file at all")
    os.close(fd)
    yield path
    os.unlink(path)


@pytest.mark.parametrize("what", ["missing path", "bad file"])
def test_a_bad_model_is_one_line_and_exit_2(what: str, bad_gguf: str) -> None:
    path = "/nonexistent/model" if what == "missing path" else bad_gguf
    r = run_serve(["--nats-port", str(free_port()), "--model-path", path])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0], r.stderr
    assert "embedded NATS" not in r.stdout  # checked before anything started


def test_a_taken_nats_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = run_serve(["--nats-port", str(taken.getsockname()[1])])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nats-port" in lines[0], r.stderr


def test_a_bad_gateway_count_is_one_line_and_exit_2() -> None:
    r = run_serve(["--nats-port", str(free_port()), "--tokenizer-worker-num", "-1"])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tokenizer-worker-num must be >= 1" in lines[0], r.stderr
    assert "embedded NATS" not in r.stdout


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--nats-cluster", "2"], "--nats-cluster must be 1 or an odd number from 3"),
        (["--nats-cluster", "3", "--nats-url", "nats://127.0.0.1:4222"], "leave out --nats-url"),
        (["--nats-replicas", "3"], "--nats-replicas 3 needs as many NATS nodes"),
    ],
)
def test_a_nats_cluster_that_cannot_work_is_one_line_and_exit_2(args: list[str], why: str) -> None:
    r = run_serve(["--nats-port", str(free_port()), *args])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0], r.stderr
    assert "embedded NATS" not in r.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_with_a_bad_model_path_is_one_line_and_exit_2(service: str) -> None:
    cmd = [sys.executable, "-m", f"services.{service}", "--model-path", "/nonexistent/model"]
    cmd += ["--port", str(free_port())] if service == "gateway" else []
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "/nonexistent/model does not exist" in lines[0], r.stderr


def test_services_that_cannot_start_stop_serve_with_exit_1(tmp_path) -> None:
    """A broken install (here the services cannot import msgspec; serve itself does not need it): the
    services die at start-up, serve stops after STARTUP_FAILURES tries each instead of restarting them
    until its start-up timeout, and the services' own tracebacks are in its output."""
    from sglbus.supervisor import STARTUP_FAILURES

    blocked = tmp_path / "msgspec"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('msgspec blocked by the test')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    # without the limit serve would retry until its 10-minute start-up timeout (run_serve's timeout fails it)
    r = run_serve(["--nats-port", str(free_port())], timeout=100, env={"PYTHONPATH": path})
    assert r.returncode == 1, r.stderr[-2000:]
    assert "msgspec blocked by the test" in r.stderr
    assert f"exited {STARTUP_FAILURES} times before the server came up" in r.stderr
    assert "sglbus is serving" not in r.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_a_nats_without_jetstream_is_one_line_and_exit_2(service: str) -> None:
    """--nats-url to a plain nats-server (no -js): one line saying what is wrong and how to fix it."""
    from shared.nats_server import nats_server_binary

    port = free_port()
    plain = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)]  # no -js
    nats = subprocess.Popen(plain, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cmd = [sys.executable, "-m", f"services.{service}", "--nats-url", f"nats://s3cret@127.0.0.1:{port}"]
        cmd += ["--port", str(free_port())] if service == "gateway" else []
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    finally:
        nats.terminate()
        nats.wait()
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no JetStream" in lines[0] and "nats-server -js" in lines[0], r.stderr
    assert "s3cret" not in r.stderr + r.stdout
