"""The served system, real parts only: an embedded nats-server on a free loopback port and the three
services as processes (`python -m services.<name>`), as `sglbus serve` runs them.

One server is shared by the whole session (`server`, and the function-scoped `srv` that waits until
the server is idle and checks KV integrity after each test); tests that kill or restart parts start
their own with `start_server`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from shared.nats_cluster import NatsCluster
from shared.nats_server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 120.0
MAX_BODY_BYTES = 1 << 20
# a small KV pool: enough for every test, and three servers at once stay cheap on a 2-core box
POOL_TOKENS = 16384
SERVICES = ("scheduler", "detokenizer", "gateway")


class ServerProcs:
    """NATS + scheduler + detokenizer + gateway, each a real process; `url` is the gateway's HTTP API.
    NATS requires a token, as under `sglbus serve`: the services get it in the environment; tests that
    talk to NATS themselves pass `nats_token`. With `nats_nodes` > 1, NATS is a cluster (`cluster`) and
    the services keep the work queue on up to 3 of its nodes."""

    def __init__(
        self, env: dict[str, str] | None = None, scheduler_args: list[str] | None = None, nats_nodes: int = 1
    ) -> None:
        self.nats_token = secrets.token_urlsafe(16)
        self.cluster = NatsCluster(nats_nodes, token=self.nats_token).start()
        self.nats = self.cluster.nodes[0]  # the one server the single-server tests restart
        self.nats_url = self.cluster.url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logdir = tempfile.mkdtemp(prefix="sglbus-it-")
        self.env = {**os.environ, "SGLBUS_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1",
                    "SGLBUS_NATS_TOKEN": self.nats_token, "SGLBUS_NATS_REPLICAS": str(min(3, nats_nodes)),
                    **(env or {})}  # fmt: skip
        self.scheduler_args = scheduler_args or []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def command(self, name: str) -> list[str]:
        bus = ["--nats-url", self.nats_url]
        args = {
            "scheduler": [*bus, "--max-total-tokens", str(POOL_TOKENS), *self.scheduler_args],
            "detokenizer": bus,
            "gateway": [*bus, "--host", "127.0.0.1", "--port", str(self.port)],
        }[name]
        return [sys.executable, "-m", f"services.{name}", *args]

    def start(self, name: str) -> None:
        with open(self.log_path(name), "ab") as log:
            self.procs[name] = subprocess.Popen(
                self.command(name), cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def start_all(self) -> ServerProcs:
        for name in SERVICES:
            self.start(name)
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during startup\n{self.tails()}")
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"/health did not answer 200 within {timeout:.0f} s\n{self.tails()}")

    def log_path(self, name: str) -> str:
        return os.path.join(self.logdir, f"{name}.log")

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            with open(self.log_path(name), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)\n"

    def tails(self) -> str:
        parts = [f"--- {n} (rc={p.poll()}) ---\n{self.tail(n)}" for n, p in self.procs.items()]
        parts += [f"--- nats-server {n.url} ---\n{n.log_tail()}" for n in self.cluster.nodes if n.dir]
        return "\n".join(parts)

    # -- faults ---------------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(30)

    def restart_nats(self, downtime: float = 0.0) -> None:
        self.nats.restart(downtime)

    # -- state ----------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        r = self.http.get("/get_server_info")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 30.0, gateway: bool = True) -> dict[str, Any]:
        """Until the scheduler runs and queues nothing and (with `gateway`) the gateway tracks no
        request either."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            busy = info["num_running_reqs"] + info["num_queue_reqs"]
            busy += info["gateway"]["in_flight"] if gateway else 0
            if not busy:
                return info
            assert time.monotonic() < deadline, (
                f"not idle after {timeout} s: running {info['num_running_reqs']}, queued "
                f"{info['num_queue_reqs']}, gateway in flight {info['gateway']['in_flight']}"
            )
            time.sleep(0.1)

    def integrity(self) -> dict[str, Any]:
        """No KV leak reported by the scheduler; when it runs nothing, it holds nothing either.
        Asked twice: the scheduler runs its idle check right after answering, so the second
        answer reflects a check made with the state the first one saw."""
        info = self.info()
        if info["num_running_reqs"] == 0:
            info = self.info()
        assert info["kv_integrity_error"] is None, info["kv_integrity_error"]
        if info["num_running_reqs"] == 0:
            assert info["num_queue_reqs"] == 0, info
            assert info["num_used_tokens"] == 0, f"idle scheduler holds {info['num_used_tokens']} KV slots"
        return info

    def settle(self, timeout: float = 30.0) -> dict[str, Any]:
        self.wait_idle(timeout)
        return self.integrity()

    # -- teardown -------------------------------------------------------------------------------
    def stop(self) -> None:
        self.http.close()
        live = [p for p in self.procs.values() if p.poll() is None]
        for name in ("gateway", "scheduler", "detokenizer"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.cluster.stop()
        # the logs go too: a failing start already put their tails into its error
        shutil.rmtree(self.logdir, ignore_errors=True)


def start_server(
    env: dict[str, str] | None = None, scheduler_args: list[str] | None = None, nats_nodes: int = 1
) -> ServerProcs:
    s = ServerProcs(env, scheduler_args, nats_nodes)
    try:
        return s.start_all()
    except BaseException:
        s.stop()
        raise


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcs]:
    s = start_server(env={"SGLBUS_MAX_BODY_BYTES": str(MAX_BODY_BYTES)})
    yield s
    s.stop()


@pytest.fixture
def srv(server: ServerProcs) -> Iterator[ServerProcs]:
    """The shared server; after the test, it must come back to idle with its KV intact."""
    yield server
    server.settle()


@pytest.fixture
def client(srv: ServerProcs) -> httpx.Client:
    return srv.http


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from shared.model_files import resolve_model_folder
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_folder(None))
