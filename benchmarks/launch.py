"""Helpers shared by the benchmarks: start `sglbus serve` on a free port (`--launch-server`), describe
the machine, append a JSONL result row, and percentiles."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from types import TracebackType
from typing import Any, NamedTuple

_STARTUP_TIMEOUT_S = 600.0  # a first start converts the GGUF and loads the model
_SERVING = re.compile(r"sglbus is serving at (\S+)")
_NATS = re.compile(r"embedded NATS \(JetStream on\) at (\S+)")
# the embedded NATS's bus-API user (a user per role: shared/nats_roles.py) and its password file
_BUS_PASSWORD = re.compile(r"user (\S+), password in ([^;)\s]+)")


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LaunchedServer:
    """`sglbus serve --port <free> <server_args>` as a child process; its output goes to a log file.
    Use as a context manager: entering waits until it prints its URL, leaving stops it (SIGTERM: `serve`
    stops its own scheduler, detokenizer, gateway and NATS)."""

    def __init__(self, server_args: str = "", host: str = "127.0.0.1", log_path: str | None = None) -> None:
        self.host, self.port = host, free_port(host)
        self.extra = shlex.split(server_args)
        self.url = f"http://{host}:{self.port}"
        self.nats_url: str | None = None
        self.nats_token: str | None = os.environ.get("SGLBUS_NATS_TOKEN")
        self.proc: subprocess.Popen[bytes] | None = None
        self.keep_log = log_path is not None  # a log named by the caller is kept
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglbus-serve-", suffix=".log")
            os.close(fd)
        self.log_path = log_path

    def __enter__(self) -> LaunchedServer:
        cmd = [sys.executable, "-m", "sglbus.cli", "serve", "--host", self.host, "--port", str(self.port)]
        if "--nats-url" not in self.extra and "--nats-port" not in self.extra:
            cmd += ["--nats-port", str(free_port(host=self.host))]  # 4222 may be another server's
        cmd += self.extra
        print(f"launching: {shlex.join(cmd)}  (log: {self.log_path})", flush=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log_text()
            if (m := _NATS.search(text)) is not None:
                self.nats_url = m.group(1)
            if (m := _BUS_PASSWORD.search(text)) is not None and self.nats_url and "@" not in self.nats_url:
                with open(m.group(2)) as f:  # the bus-API user's credentials go into the URL
                    login = f"{m.group(1)}:{urllib.parse.quote(f.read().strip(), safe='')}@"
                self.nats_url = self.nats_url.replace("://", f"://{login}", 1)
            if (m := _SERVING.search(text)) is not None:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        tail = "\n".join(self.log_text().splitlines()[-30:])
        self.stop()
        raise RuntimeError(f"sglbus serve did not become healthy; log tail:\n{tail}")

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if et is None and not self.keep_log:  # kept after a failure, for context
            os.unlink(self.log_path)

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def add_target_args(p: Any, nats: bool = False) -> None:
    """The options `target()` reads: a server to launch, or the address of a running one."""
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (wins over host/port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--launch-server", action="store_true", help="start `sglbus serve` on a free port")
    p.add_argument(
        "--server-args",
        default="",
        help='with --launch-server, e.g. "--max-running-requests 32" '
        "(one dash-led word takes '=': --server-args=--disable-radix-cache)",
    )
    p.add_argument("--server-log", default=None, help="keep the launched server's log here")
    if nats:
        p.add_argument("--nats-url", default=os.environ.get("SGLBUS_NATS_URL"), help="the server's NATS")


class Target(NamedTuple):
    """The server a benchmark measures: its HTTP base URL, its NATS URL and token (None if unknown)."""

    base: str
    nats_url: str | None
    nats_token: str | None
    pid: int | None = None  # the launched `sglbus serve`'s process


@contextlib.contextmanager
def target(args: Any) -> Iterator[Target]:
    """`sglbus serve` launched for the run (`--launch-server`, `--server-args`), or the server named by
    `--base-url` / `--host` `--port`, with `--nats-url` (and SGLBUS_NATS_TOKEN) for its bus."""
    nats_url = getattr(args, "nats_url", None)
    if args.launch_server:
        with LaunchedServer(args.server_args, args.host, getattr(args, "server_log", None)) as server:
            pid = server.proc.pid if server.proc else None
            yield Target(server.url, server.nats_url or nats_url, server.nats_token, pid)
    else:
        base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        yield Target(base, nats_url, os.environ.get("SGLBUS_NATS_TOKEN"))


def machine_info() -> dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=here
        )
        commit: str | None = rev.stdout.strip() or None
    except OSError:
        commit = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": os.getloadavg()[0],
        "git": commit,
    }


def append_result(path: str, args: dict[str, Any], machine: dict[str, Any], result: dict[str, Any]) -> None:
    """Append one JSONL row: when, the exact command, its arguments, the machine, and the figures."""
    row = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": shlex.join(sys.orig_argv), "args": args, "machine": machine, **result}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 for an empty list."""
    import numpy as np

    return float(np.percentile(values, q)) if values else 0.0
