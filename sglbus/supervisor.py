"""`sglbus serve`'s supervision of the processes it started: each service in its own session, restarted
with backoff when it dies, killed (SIGKILL) and restarted when its watchdog beats say it hangs
(shared/watchdog.py), and stopped in order: the gateways drain first, then the scheduler and
detokenizer, then the embedded NATS (one node or a cluster: each node is restarted on its own)."""

from __future__ import annotations

import functools
import logging
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

from shared.nats_cluster import NatsCluster
from shared.nats_server import EmbeddedNats
from shared.service_main import EXIT_CONFIG
from shared.watchdog import ENV as WATCHDOG_ENV
from shared.watchdog import WatchdogPipe

log = logging.getLogger("sglbus.serve")

_STARTUP_TIMEOUT_S = 600.0  # a first start converts the GGUF and loads the model
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 30.0
STABLE_S = 60.0  # up this long, a process counts as healthy again: its next restart waits BACKOFF_MIN_S
STOP_TIMEOUT_S = 15.0  # per shutdown stage (the gateways': after their drain); then it is killed
AFTER_SECOND_SIGNAL_S = 5.0  # a second Ctrl-C ends the gateways' drain: this long to answer, then killed
# serve's own loop did not turn for this long (it was stopped or starved): no child is judged on that time
_SELF_STALL_S = 5.0
# a service that dies this often before the server first answers /health is not coming up (a broken
# install, a model that does not load): serve stops and exits 1 instead of retrying to the start-up timeout
STARTUP_FAILURES = 3
_POLL_S = 0.25


@functools.cache
def die_with_parent() -> Callable[[], None] | None:
    """Linux: the child gets SIGTERM when serve dies, even by SIGKILL, so no orphan keeps the ports.
    (The children run in their own sessions, where no terminal signal reaches them.)"""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


class Backoff:
    """When to restart a process that died: 1 s, doubling to 30 s; back to 1 s once it stayed up 60 s."""

    def __init__(self) -> None:
        self.delay, self.started = BACKOFF_MIN_S, time.monotonic()
        self.due: float | None = None  # when to restart; None while it runs

    def up(self) -> None:
        self.started, self.due = time.monotonic(), None

    def down(self) -> tuple[float, float]:
        """(seconds it was up, seconds until its restart)."""
        now = time.monotonic()
        uptime = now - self.started
        if uptime >= STABLE_S:
            self.delay = BACKOFF_MIN_S
        delay, self.delay = self.delay, min(2 * self.delay, BACKOFF_MAX_S)
        self.due = now + delay
        return uptime, delay

    def ready(self) -> bool:
        return self.due is not None and time.monotonic() >= self.due


class Child:
    """One service process (`python -m <module> ...`), in its own session, its restart schedule and,
    with the watchdog on, the pipe its beats come down."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name, self.cmd, self.env = name, [sys.executable, "-m", *args], env
        self.proc: subprocess.Popen[bytes] | None = None
        self.backoff = Backoff()
        self.startup_exits = 0  # exits before the server first answered /health
        self.watch: WatchdogPipe | None = None

    def start(self, watchdog: bool = False) -> None:
        self.unwatch()
        env, fds = self.env, ()
        if watchdog:
            self.watch = WatchdogPipe()
            env, fds = {**env, WATCHDOG_ENV: str(self.watch.write_fd)}, (self.watch.write_fd,)
        self.proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL, pass_fds=fds,
                                     start_new_session=True, preexec_fn=die_with_parent())  # fmt: skip
        if self.watch is not None:
            self.watch.child_started()
        self.backoff.up()

    def hung(self, now: float, timeout: float, serving: bool) -> str | None:
        """Why this running child counts as hung, or None (see shared/watchdog.py)."""
        if self.watch is None or not self.running:
            return None
        self.watch.read(now)
        if self.watch.last_beat is None:  # a restart that never came up (the first start: run's limit)
            late = serving and now - self.watch.started > _STARTUP_TIMEOUT_S
            return f"did not come up within {_STARTUP_TIMEOUT_S:.0f} s" if late else None
        return self.watch.hung(now, timeout)

    def exited(self) -> None:
        self.proc = None
        self.unwatch()

    def unwatch(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class NatsNode:
    """One embedded nats-server and its restart schedule: restarted on its port and store when it dies,
    as a service is; in a cluster it rejoins the others by its routes."""

    def __init__(self, server: EmbeddedNats) -> None:
        self.server, self.backoff, self.up = server, Backoff(), True

    def tend(self) -> None:
        server = self.server
        if self.up and (rc := server.exit_code()) is not None:
            self.up = False
            uptime, delay = self.backoff.down()
            log.warning("nats-server exited (%s) after %.0f s; restarting it on port %d in %.0f s",
                        describe_exit(rc), uptime, server.port, delay)  # fmt: skip
        if not self.up and self.backoff.ready():
            try:
                server.restart()  # same port, store and credentials: clients reconnect by themselves
            except RuntimeError as e:  # PortInUse included: someone took the port meanwhile
                _, delay = self.backoff.down()
                log.error(
                    "nats-server did not restart: %s; next try in %.0f s", str(e).splitlines()[0], delay
                )
                return
            self.up = True
            self.backoff.up()
            log.warning("nats-server restarted at %s", server.url)


class Supervisor:
    def __init__(self, children: list[Child], nats: NatsCluster | None, watchdog_timeout: float = 0.0,
                 shutdown_timeout: float = 0.0) -> None:  # fmt: skip
        self.children, self.nats = children, nats
        self.nats_nodes = [NatsNode(server) for server in nats.nodes] if nats is not None else []
        self.watchdog_timeout, self.shutdown_timeout = watchdog_timeout, shutdown_timeout
        self.signals = 0
        self.serving = False  # /health answered 200 once
        self._last_tend = time.monotonic()

    def on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        if self.signals == 2:
            log.warning("second %s: the gateways end their drain now; each stage gets %.0f s more, then "
                        "is killed", signal.Signals(signum).name, AFTER_SECOND_SIGNAL_S)  # fmt: skip
        elif self.signals > 2:
            log.warning("%s: killing what is still running", signal.Signals(signum).name)

    def run(self, url: str, api_key: bool) -> int:
        for child in self.children:
            child.start(self.watchdog_timeout > 0)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self.signals:
            rc = self.tend(starting=not self.serving)
            if rc is not None:
                return rc
            if not self.serving and _healthy(url):
                self.serving = True
                note = "API key required; " if api_key else ""
                print(f"sglbus is serving at {url}  ({note}Ctrl-C stops it)", flush=True)
            elif not self.serving and time.monotonic() > deadline:
                log.error("/health did not answer 200 within %.0f s: stopping", _STARTUP_TIMEOUT_S)
                return 1
            time.sleep(_POLL_S)
        return 0

    def tend(self, starting: bool = False) -> int | None:
        """Restart what died, when its backoff allows, and kill what hangs (the watchdog); EXIT_CONFIG
        once a child exits with it, 1 once a child died STARTUP_FAILURES times while `starting` (the
        server never answered /health yet)."""
        for node in self.nats_nodes:
            node.tend()
        self._watch()
        for c in self.children:
            rc = None if c.proc is None else c.proc.poll()
            if rc is not None:
                c.exited()
                if rc == EXIT_CONFIG:
                    log.error("%s exited with code 2 (a configuration error, see above): stopping", c.name)
                    return EXIT_CONFIG
                c.startup_exits += starting
                if c.startup_exits >= STARTUP_FAILURES:
                    log.error("%s exited %d times before the server came up (last: %s; its output is "
                              "above): stopping", c.name, c.startup_exits, describe_exit(rc))  # fmt: skip
                    return 1
                uptime, delay = c.backoff.down()
                log.warning("%s exited (%s) after %.0f s; restarting it in %.0f s",
                            c.name, describe_exit(rc), uptime, delay)  # fmt: skip
            if c.proc is None and c.backoff.ready():
                c.start(self.watchdog_timeout > 0)
                log.warning("%s restarted (pid %d)", c.name, c.proc.pid)
        return None

    def _watch(self) -> None:
        """Kill (SIGKILL) a child that stopped making progress: it is restarted as if it had crashed
        (its work-queue deliveries go to the next scheduler, its streams end with an error)."""
        now = time.monotonic()
        stalled_self, self._last_tend = now - self._last_tend > _SELF_STALL_S, now
        if self.watchdog_timeout <= 0:
            return
        for c in self.children:
            if stalled_self and c.watch is not None:
                c.watch.restart_clock(now)
            why = c.hung(now, self.watchdog_timeout, self.serving)
            if why is not None:
                log.error("%s (pid %d) %s: killing it (SIGKILL); it is restarted like a crash",
                          c.name, c.proc.pid, why)  # fmt: skip
                c.proc.kill()  # not waited for here: a process stuck in the kernel dies when it leaves it
                c.unwatch()  # judged once; its exit is handled as any other

    def shutdown(self) -> None:
        """Gateway first (it refuses new requests and drains those in flight for up to
        shutdown_timeout), then the pipeline behind it, then the bus, each waited for, so nothing logs
        about a bus that went away under it."""
        gateways = [c for c in self.children if c.name == "gateway" and c.running]
        self._stop(gateways, self.shutdown_timeout + STOP_TIMEOUT_S)
        pipeline = [c for c in self.children if c.name in ("scheduler", "detokenizer") and c.running]
        self._stop(pipeline, STOP_TIMEOUT_S)
        if self.nats is not None:
            log.info("stopping nats-server")
            self.nats.stop()

    def _stop(self, children: list[Child], timeout: float) -> None:
        if not children:
            return
        log.info("stopping %s", ", ".join(c.name for c in children))
        for c in children:
            c.proc.send_signal(signal.SIGTERM)
        deadline, forwarded = time.monotonic() + timeout, False
        while any(c.running for c in children) and time.monotonic() < deadline and self.signals < 3:
            if self.signals >= 2 and not forwarded:  # a second Ctrl-C: a gateway ends its drain now
                forwarded = True
                for c in children:
                    if c.running:
                        c.proc.send_signal(signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + AFTER_SECOND_SIGNAL_S)
            time.sleep(0.05)
        for c in children:
            if c.running:
                log.warning("%s did not stop: killing it", c.name)
                c.proc.kill()
            c.proc.wait()
            c.exited()


def _own_gateway_tls() -> ssl.SSLContext:
    """HTTPS to our own gateways on the address we told them to bind: their certificate names the host
    clients use, not this address, and serve only asks whether they answer."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


# no http_proxy for our own port
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                      urllib.request.HTTPSHandler(context=_own_gateway_tls()))  # fmt: skip


def _healthy(url: str) -> bool:
    try:
        with _DIRECT.open(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
