"""`sglbus serve`: an embedded NATS (unless --nats-url), then the scheduler, detokenizer and gateway as
processes; waits for /health and prints the URL.

It supervises what it started: a service that dies is restarted with backoff (1 s, doubling to 30 s),
and so is the embedded NATS, on the same port and JetStream store; the services reconnect by
themselves. A service that is alive but hung (stopped, its event loop blocked, the scheduler's step
thread stuck in one step) for --watchdog-timeout seconds is killed with SIGKILL and restarted the
same way (shared/watchdog.py: each service beats down a pipe). A service that exits with code 2
reports a configuration error: serve stops everything and exits 2. One that dies STARTUP_FAILURES
times before the server first answers /health (an import error, a model that does not load) stops
everything too, with exit code 1; its output is above.
Ctrl-C / SIGTERM stop the gateway first: it refuses new requests (503) and lets those in flight finish
for up to --shutdown-timeout seconds, ending the rest with an error that says so; then the scheduler
and detokenizer, then NATS. A second Ctrl-C ends the drain at once.

The embedded NATS requires a token, generated at each start unless --nats-token is given, written to
$SGLBUS_CACHE_DIR/nats-token (readable by you only) for bus-API clients, and handed to the services
through the environment, never the command line (`ps` shows command lines to every user).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable

from services.gateway.config import GatewayConfig
from shared.config import EngineConfig, add_cli_args, cli_overrides, from_env
from shared.nats_server import EmbeddedNats, PortInUse, port_in_use
from shared.service_main import (
    EXIT_CONFIG,
    ServiceExit,
    add_bus_args,
    add_log_args,
    model_folder,
    setup_logging,
)
from shared.watchdog import ENV as WATCHDOG_ENV
from shared.watchdog import WatchdogPipe

log = logging.getLogger("sglbus.serve")

_STARTUP_TIMEOUT_S = 600.0  # a first start converts the GGUF and loads the model
DEFAULT_NATS_PORT = 4222
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 30.0
STABLE_S = 60.0  # up this long, a process counts as healthy again: its next restart waits BACKOFF_MIN_S
STOP_TIMEOUT_S = 15.0  # per shutdown stage (the gateways': after their drain); then it is killed
AFTER_SECOND_SIGNAL_S = 5.0  # a second Ctrl-C ends the gateways' drain: this long to answer, then killed
# a hung service is killed after this long without progress; generous: a CPU prefill of 2048 tokens of
# the default model takes ~4 s on 2 idle cores, and a step of a bigger model on CPU may take far longer
WATCHDOG_TIMEOUT_S = 60.0
# serve's own loop did not turn for this long (it was stopped or starved): no child is judged on that time
_SELF_STALL_S = 5.0
# a service that dies this often before the server first answers /health is not coming up (a broken
# install, a model that does not load): serve stops and exits 1 instead of retrying to the start-up timeout
STARTUP_FAILURES = 3
_POLL_S = 0.25
_CREDENTIALS = ("SGLBUS_NATS_TOKEN", "SGLBUS_NATS_USER", "SGLBUS_NATS_PASSWORD", "SGLBUS_NATS_CREDS")


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="sglbus serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_log_args(p)
    add_cli_args(p, GatewayConfig, only=("host", "port", "api_key", "served_model_name", "shutdown_timeout"))
    p.add_argument("--tokenizer-worker-num", type=int, default=env("SGLBUS_TOKENIZER_WORKER_NUM", "0"),
                   help="gateway processes sharing the HTTP port, as SGLang's tokenizer workers: each "
                        "parses, tokenizes and streams its share of the connections (default: 0, one per 8 "
                        "CPU cores, 1 to 4; env SGLBUS_TOKENIZER_WORKER_NUM)")  # fmt: skip
    p.add_argument("--watchdog-timeout", type=float,
                   default=env("SGLBUS_WATCHDOG_TIMEOUT", str(WATCHDOG_TIMEOUT_S)),
                   help="seconds a service may go without progress (stopped, its event loop blocked, the "
                        "scheduler inside one step) before serve kills it with SIGKILL and restarts it; "
                        f"0 turns the watchdog off (default: {WATCHDOG_TIMEOUT_S:g}; "
                        "env SGLBUS_WATCHDOG_TIMEOUT)")  # fmt: skip
    bus = add_bus_args(p, url=False, token_default="with the embedded NATS, a new random one")
    bus.add_argument("--nats-url", default=env("SGLBUS_NATS_URL"),
                     help="use this NATS server instead of starting one (default: unset, an embedded NATS; "
                          "env SGLBUS_NATS_URL)")  # fmt: skip
    bus.add_argument("--nats-port", type=int, default=env("SGLBUS_NATS_PORT", str(DEFAULT_NATS_PORT)),
                     help=f"port of the embedded NATS, on 127.0.0.1 (default: {DEFAULT_NATS_PORT}; "
                          "env SGLBUS_NATS_PORT)")  # fmt: skip
    add_cli_args(p, EngineConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("serve", args.log_level)
    gateways = args.tokenizer_worker_num or default_gateways()
    if gateways < 1:
        return _fail(f"--tokenizer-worker-num must be >= 1 (or 0 for the default), got {gateways}")
    if not args.watchdog_timeout >= 0:
        return _fail(
            f"--watchdog-timeout must be >= 0 (0 turns the watchdog off), got {args.watchdog_timeout}"
        )
    try:
        engine = cli_overrides(args, EngineConfig)
        cfg = EngineConfig.from_env(**engine)  # fail fast on a bad option, before anything starts
        gw = from_env(GatewayConfig, **cli_overrides(args, GatewayConfig))
        model_folder(cfg.model_path, cfg.load_format != "dummy")  # converts a GGUF once, for all three
    except (ValueError, ServiceExit) as e:
        return _fail(str(e))
    if port_in_use(gw.host, gw.port):
        return _fail(f"port {gw.port} on {gw.host} is in use by another process; pick another with --port")
    if args.nats_url is None and args.nats_creds:
        return _fail("--nats-creds needs --nats-url: the embedded NATS takes a token or a user and password")

    nats, credentials = None, _given_credentials(args)
    if args.nats_url is None:
        try:
            nats, credentials, note = _start_nats(args)
        except PortInUse as e:
            return _fail(f"{e}: another sglbus serve or NATS? pick another port with --nats-port")
        except ValueError as e:
            return _fail(str(e))
        except RuntimeError as e:
            return _fail(str(e), code=1)
        nats_url = nats.url
        print(f"embedded NATS (JetStream on) at {nats_url} ({note})", flush=True)
    else:
        nats_url = args.nats_url
        print(f"using NATS at {nats_url}", flush=True)

    env = {k: v for k, v in os.environ.items() if k not in _CREDENTIALS and k != "SGLBUS_API_KEY"}
    env.update(credentials, SGLBUS_LOG_LEVEL=args.log_level, PYTHONUNBUFFERED="1")
    pick = lambda *names: {k: engine[k] for k in names if k in engine}
    common = pick("model_path", "tokenizer_path", "subject_prefix")
    bus = ["--nats-url", nats_url]
    http = ["--host", gw.host, "--port", str(gw.port)]
    if gw.served_model_name:
        http += ["--served-model-name", gw.served_model_name]
    http += ["--shutdown-timeout", str(gw.shutdown_timeout)]  # serve waits that long for the gateways
    if gateways > 1:
        http.append("--reuse-port")
    gw_env = {**env, "SGLBUS_API_KEY": gw.api_key} if gw.api_key else env
    children = [
        *(Child("gateway", ["services.gateway", *bus, *http, *_flags(common)], gw_env)
          for _ in range(gateways)),
        Child("scheduler", ["services.scheduler", *bus, *_flags(engine)], env),
        Child("detokenizer", ["services.detokenizer", *bus, *_flags({**common, **pick("worker_id")})], env),
    ]  # fmt: skip
    sup = Supervisor(children, nats, args.watchdog_timeout, gw.shutdown_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, sup.on_signal)
    try:
        return sup.run(f"http://{gw.host}:{gw.port}", bool(gw.api_key))
    finally:
        sup.shutdown()


def default_gateways() -> int:
    """One gateway per 8 CPU cores, 1 to 4: at ~20k streamed tokens a second (an 8B model on an H200)
    one gateway process is a core's worth of Python and socket writes, the limit of the served run."""
    return max(1, min(4, (os.cpu_count() or 1) // 8))


def _fail(message: str, code: int = EXIT_CONFIG) -> int:
    print(f"sglbus serve: error: {message}", file=sys.stderr, flush=True)
    return code


def _given_credentials(args: argparse.Namespace) -> dict[str, str]:
    given = {"SGLBUS_NATS_TOKEN": args.nats_token, "SGLBUS_NATS_USER": args.nats_user,
             "SGLBUS_NATS_PASSWORD": args.nats_password, "SGLBUS_NATS_CREDS": args.nats_creds}  # fmt: skip
    return {k: v for k, v in given.items() if v}


def _start_nats(args: argparse.Namespace) -> tuple[EmbeddedNats, dict[str, str], str]:
    """The embedded NATS with credentials: the user and password given, else a token (given or new)."""
    if args.nats_user or args.nats_password:
        nats = EmbeddedNats(port=args.nats_port, user=args.nats_user, password=args.nats_password,
                            preexec_fn=_die_with_parent())  # fmt: skip
        env = {"SGLBUS_NATS_USER": args.nats_user, "SGLBUS_NATS_PASSWORD": args.nats_password}
        return nats.start(), env, f"bus clients: user {args.nats_user} and your password"
    token = args.nats_token or secrets.token_urlsafe(24)
    nats = EmbeddedNats(port=args.nats_port, token=token, preexec_fn=_die_with_parent()).start()
    path = _write_token_file(token)
    return nats, {"SGLBUS_NATS_TOKEN": token}, f"bus clients: the token is in {path}"


def _write_token_file(token: str) -> str:
    from shared.model_files import cache_root

    path = os.path.join(cache_root(), "nats-token")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # a private temp file renamed over the old one: never readable by others, never half-written,
    # and a symlink planted at `path` is replaced, not followed
    fd, tmp = tempfile.mkstemp(prefix=".nats-token-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return path


def _flags(values: dict) -> list[str]:
    out = []
    for k, v in values.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


@functools.cache
def _die_with_parent() -> Callable[[], None] | None:
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
                                     start_new_session=True, preexec_fn=_die_with_parent())  # fmt: skip
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


class Supervisor:
    def __init__(self, children: list[Child], nats: EmbeddedNats | None, watchdog_timeout: float = 0.0,
                 shutdown_timeout: float = 0.0) -> None:  # fmt: skip
        self.children, self.nats = children, nats
        self.nats_backoff, self.nats_up = Backoff(), nats is not None
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
        self._tend_nats()
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

    def _tend_nats(self) -> None:
        nats = self.nats
        if nats is None:
            return
        if self.nats_up and (rc := nats.exit_code()) is not None:
            self.nats_up = False
            uptime, delay = self.nats_backoff.down()
            log.warning("nats-server exited (%s) after %.0f s; restarting it on port %d in %.0f s",
                        describe_exit(rc), uptime, nats.port, delay)  # fmt: skip
        if not self.nats_up and self.nats_backoff.ready():
            try:
                nats.restart()  # same port, store and credentials: clients reconnect by themselves
            except RuntimeError as e:  # PortInUse included: someone took the port meanwhile
                _, delay = self.nats_backoff.down()
                log.error(
                    "nats-server did not restart: %s; next try in %.0f s", str(e).splitlines()[0], delay
                )
                return
            self.nats_up = True
            self.nats_backoff.up()
            log.warning("nats-server restarted at %s", nats.url)

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


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy for our own port


def _healthy(url: str) -> bool:
    try:
        with _DIRECT.open(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
