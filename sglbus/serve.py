"""`sglbus serve`: an embedded NATS (unless --nats-url), then the scheduler, detokenizer and gateway as
processes; waits for /health and prints the URL.

It supervises what it started (sglbus/supervisor.py): a service that dies is restarted with backoff
(1 s, doubling to 30 s), and so is the embedded NATS, on the same port and JetStream store; the services
reconnect by themselves. A service that is alive but hung (stopped, its event loop blocked, the
scheduler's step thread stuck in one step) for --watchdog-timeout seconds is killed with SIGKILL and
restarted the same way (shared/watchdog.py: each service beats down a pipe). A service that exits with
code 2 reports a configuration error: serve stops everything and exits 2. One that dies STARTUP_FAILURES
times before the server first answers /health (an import error, a model that does not load) stops
everything too, with exit code 1; its output is above.
Ctrl-C / SIGTERM stop the gateway first: it refuses new requests (503) and lets those in flight finish
for up to --shutdown-timeout seconds, ending the rest with an error that says so; then the scheduler
and detokenizer, then NATS. A second Ctrl-C ends the drain at once.

With --nats-cluster N (3, 5, ...) the embedded NATS is a cluster of N nodes on loopback, the work queue
kept on 3 of them: any one node may die (it is restarted like the single one) and no accepted request is
lost. With --nats-url, several comma-separated URLs name the nodes of your own cluster.

The embedded NATS has one user per role, each allowed only the subjects it uses (shared/nats_roles.py):
gateway, scheduler, detokenizer, and bus-api for bus-API clients, which may only ask <prefix>.api.>.
Their passwords are new at each start (the bus-api one fixed with --nats-password); the services get
theirs through the environment, never the command line (`ps` shows command lines to every user), and the
bus-api password is written to $SGLBUS_CACHE_DIR/nats-bus-api-password (nats-bus-api-password-<port>
with a --nats-port other than 4222; readable by you only; removed at exit). --nats-tls-cert and
--nats-tls-key make it require TLS; --ssl-certfile and --ssl-keyfile make the gateways serve HTTPS.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile

from services.gateway.config import GatewayConfig
from sglbus.supervisor import Child, Supervisor, die_with_parent
from shared.config import EngineConfig, add_cli_args, cli_overrides, from_env
from shared.nats_cluster import ROUTE_PORT_OFFSET, NatsCluster
from shared.nats_roles import BUS_API, DETOKENIZER, GATEWAY, SCHEDULER, RoleUsers
from shared.nats_server import PortInUse, port_in_use
from shared.nats_transport import redact_url
from shared.service_main import (
    EXIT_CONFIG,
    ServiceExit,
    add_bus_args,
    add_log_args,
    model_folder,
    setup_logging,
)

log = logging.getLogger("sglbus.serve")

DEFAULT_NATS_PORT = 4222
# the work queue of an embedded cluster on 3 nodes: it survives the loss of one; more copies would make
# every publish wait for a wider quorum
CLUSTER_REPLICAS = 3
# a hung service is killed after this long without progress; generous: a CPU prefill of 2048 tokens of
# the default model takes ~4 s on 2 idle cores, and a step of a bigger model on CPU may take far longer
WATCHDOG_TIMEOUT_S = 60.0
# the gateways' limits on what one client may ask (README, after the serve options)
GATEWAY_LIMITS = (
    "max_request_states",
    "max_inflight_requests",
    "max_inflight_per_client",
    "max_connections",
    "max_body_bytes",
    "max_buffered_bytes",
    "allowed_hosts",
    "grammar_check_timeout",
    "allowed_media_dir",
)
_CREDENTIALS = ("SGLBUS_NATS_TOKEN", "SGLBUS_NATS_USER", "SGLBUS_NATS_PASSWORD", "SGLBUS_NATS_CREDS",
                "SGLBUS_NATS_TLS_CA")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="sglbus serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_log_args(p)
    gateway_options = ("host", "port", "api_key", "admin_api_key", "served_model_name", "reasoning_parser",
                       "shutdown_timeout", "router_policy", "router_balance_weight",
                       "worker_recovery_timeout", "ssl_certfile", "ssl_keyfile", *GATEWAY_LIMITS)  # fmt: skip
    add_cli_args(p, GatewayConfig, only=gateway_options)
    p.add_argument("--tokenizer-worker-num", type=int, default=env("SGLBUS_TOKENIZER_WORKER_NUM", "0"),
                   help="gateway processes sharing the HTTP port, as SGLang's tokenizer workers: each "
                        "parses, tokenizes and streams its share of the connections (default: 0, one per 8 "
                        "CPU cores, 1 to 4; env SGLBUS_TOKENIZER_WORKER_NUM)")  # fmt: skip
    p.add_argument("--dp-size", type=int, default=env("SGLBUS_DP_SIZE", "1"),
                   help="scheduler workers (each a scheduler and its detokenizer), as SGLang's data "
                        "parallelism: one per GPU where there are that many, else sharing the device, "
                        "each with an even share of --max-total-tokens; the gateways route each request "
                        "to one of them (--router-policy) (default: 1; env SGLBUS_DP_SIZE)")  # fmt: skip
    p.add_argument("--watchdog-timeout", type=float,
                   default=env("SGLBUS_WATCHDOG_TIMEOUT", str(WATCHDOG_TIMEOUT_S)),
                   help="seconds a service may go without progress (stopped, its event loop blocked, the "
                        "scheduler inside one step) before serve kills it with SIGKILL and restarts it; "
                        f"0 turns the watchdog off (default: {WATCHDOG_TIMEOUT_S:g}; "
                        "env SGLBUS_WATCHDOG_TIMEOUT)")  # fmt: skip
    bus = add_bus_args(p, url=False)
    bus.add_argument("--nats-url", default=env("SGLBUS_NATS_URL"),
                     help="use this NATS server instead of starting one (default: unset, an embedded NATS; "
                          "env SGLBUS_NATS_URL)")  # fmt: skip
    bus.add_argument("--nats-port", type=int, default=env("SGLBUS_NATS_PORT", str(DEFAULT_NATS_PORT)),
                     help=f"port of the embedded NATS, on 127.0.0.1; in a cluster, node i's client port is "
                          f"this + i and its route port this + {ROUTE_PORT_OFFSET} + i "
                          f"(default: {DEFAULT_NATS_PORT}; env SGLBUS_NATS_PORT)")  # fmt: skip
    bus.add_argument("--nats-cluster", type=int, default=env("SGLBUS_NATS_CLUSTER", "1"),
                     help="nodes of the embedded NATS: 1, or an odd number from 3 for a cluster that "
                          f"survives the loss of a node (the work queue on {CLUSTER_REPLICAS} of them, or "
                          "--nats-replicas) (default: 1; env SGLBUS_NATS_CLUSTER)")  # fmt: skip
    bus.add_argument("--nats-tls-cert", default=env("SGLBUS_NATS_TLS_CERT"),
                     help="the embedded NATS requires TLS with this certificate (PEM, with its chain) and "
                          "--nats-tls-key; the services check it against --nats-tls-ca, else against the "
                          "certificate itself (default: unset; env SGLBUS_NATS_TLS_CERT)")  # fmt: skip
    bus.add_argument("--nats-tls-key", default=env("SGLBUS_NATS_TLS_KEY"),
                     help="the private key (PEM) of --nats-tls-cert (default: unset; env "
                          "SGLBUS_NATS_TLS_KEY)")  # fmt: skip
    add_cli_args(p, EngineConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("serve", args.log_level)
    gateways = args.tokenizer_worker_num or default_gateways()
    if gateways < 1:
        return _fail(f"--tokenizer-worker-num must be >= 1 (or 0 for the default), got {gateways}")
    if args.dp_size < 1:
        return _fail(f"--dp-size must be >= 1, got {args.dp_size}")
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
    why = _bad_cluster(args) or _bad_nats_auth(args)
    if why:
        return _fail(why)

    nats, roles = None, None
    if args.nats_url is None:
        try:
            nats, roles, note = _start_nats(args, cfg.subject_prefix)
        except PortInUse as e:
            return _fail(f"{e}: another sglbus serve or NATS? pick another port with --nats-port")
        except ValueError as e:
            return _fail(str(e))
        except RuntimeError as e:
            return _fail(str(e), code=1)
        nats_url = nats.url
        what = "NATS" if args.nats_cluster == 1 else f"NATS cluster of {args.nats_cluster} nodes"
        print(f"embedded {what} (JetStream on) at {redact_url(nats_url)} ({note})", flush=True)
    else:
        nats_url = args.nats_url
        print(f"using NATS at {redact_url(nats_url)}", flush=True)

    env = {k: v for k, v in os.environ.items() if k not in _CREDENTIALS and k != "SGLBUS_API_KEY"}
    env.update(SGLBUS_LOG_LEVEL=args.log_level, PYTHONUNBUFFERED="1",
               SGLBUS_NATS_REPLICAS=str(_replicas(args)))  # fmt: skip
    if args.nats_tls_ca or args.nats_tls_cert:
        env["SGLBUS_NATS_TLS_CA"] = os.path.abspath(args.nats_tls_ca or args.nats_tls_cert)
    # each service connects as its role; to a NATS of your own, with the credentials given
    bus_env = lambda role: {**env, **(roles.env(role) if roles else _given_credentials(args))}
    pick = lambda *names: {k: engine[k] for k in names if k in engine}
    common = pick("model_path", "tokenizer_path", "subject_prefix")
    bus = ["--nats-url", nats_url]
    http = ["--host", gw.host, "--port", str(gw.port)]
    if gw.served_model_name:
        http += ["--served-model-name", gw.served_model_name]
    http += ["--router-policy", gw.router_policy, "--router-balance-weight", str(gw.router_balance_weight),
             "--worker-recovery-timeout", str(gw.worker_recovery_timeout)]  # fmt: skip
    if gw.reasoning_parser:
        http += ["--reasoning-parser", gw.reasoning_parser]
    http += ["--shutdown-timeout", str(gw.shutdown_timeout)]  # serve waits that long for the gateways
    http += _flags({k: getattr(gw, k) for k in (*GATEWAY_LIMITS, "ssl_certfile", "ssl_keyfile")
                    if getattr(gw, k) is not None})  # fmt: skip
    if gateways > 1:
        http.append("--reuse-port")
    keys = {"SGLBUS_API_KEY": gw.api_key, "SGLBUS_ADMIN_API_KEY": gw.admin_api_key}
    # by environment: a command line is public
    gw_env = {**bus_env(GATEWAY), **{k: v for k, v in keys.items() if v}}
    children = [
        *(Child("gateway", ["services.gateway", *bus, *http, *_flags(common)], gw_env)
          for _ in range(gateways)),
    ]  # fmt: skip
    try:
        workers = worker_options(engine, cfg, args.dp_size)
    except ValueError as e:
        return _fail(str(e))
    for opts in workers:
        detok = {**common, **({"worker_id": opts["worker_id"]} if "worker_id" in opts else {})}
        children.append(Child("scheduler", ["services.scheduler", *bus, *_flags(opts)], bus_env(SCHEDULER)))
        children.append(Child("detokenizer", ["services.detokenizer", *bus, *_flags(detok)],
                              bus_env(DETOKENIZER)))  # fmt: skip
    sup = Supervisor(children, nats, args.watchdog_timeout, gw.shutdown_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, sup.on_signal)
    try:
        return sup.run(f"{'https' if gw.ssl_certfile else 'http'}://{gw.host}:{gw.port}", bool(gw.api_key))
    finally:
        sup.shutdown()
        if roles is not None and not args.nats_password:
            _forget_password(roles.passwords[BUS_API], args.nats_port)


def worker_options(engine: dict, cfg: EngineConfig, dp_size: int) -> list[dict]:
    """Each scheduler worker's options: worker ids 0..dp_size-1 (or the one --worker-id with one
    worker), tp_size GPUs each where there are as many (worker i from cuda:i*tp_size), else the
    device shared, each with an even share of the KV memory (--max-total-tokens; on CPU, the default
    pool's share of RAM)."""
    if dp_size == 1:
        return [engine]
    if "worker_id" in engine:
        raise ValueError("--worker-id names a single worker: leave it unset with --dp-size (ids 0..N-1)")
    gpus = _gpu_count() if cfg.device in ("auto", "cuda") else 0
    if cfg.tp_size > 1 and gpus and gpus < dp_size * cfg.tp_size:
        raise ValueError(f"--dp-size {dp_size} x --tp-size {cfg.tp_size} needs {dp_size * cfg.tp_size} GPUs "
                         f"(one per rank), found {gpus}")  # fmt: skip
    out = []
    for i in range(dp_size):
        opts = {**engine, "worker_id": str(i)}
        if gpus >= dp_size * cfg.tp_size:
            opts["device"] = f"cuda:{i * cfg.tp_size}"
        elif cfg.max_total_tokens:
            opts["max_total_tokens"] = max(2, cfg.max_total_tokens // dp_size)
        elif gpus or cfg.device.startswith("cuda"):
            raise ValueError(f"--dp-size {dp_size} workers share a GPU (found {gpus}): give "
                             "--max-total-tokens, the KV pool of all of them, to split evenly")  # fmt: skip
        else:  # CPU: each takes its share of the default pool's RAM
            opts["mem_fraction_static"] = (cfg.mem_fraction_static or 0.15) / dp_size
        out.append(opts)
    return out


def _gpu_count() -> int:
    import torch  # only here: serve starts without importing torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def _bad_nats_auth(args: argparse.Namespace) -> str | None:
    """Why the NATS credentials or TLS options cannot work together, or None."""
    tls = [f"--nats-tls-{what}" for what in ("cert", "key") if getattr(args, f"nats_tls_{what}")]
    if args.nats_url is not None:
        return f"{' and '.join(tls)} set up the embedded NATS: leave out --nats-url" if tls else None
    given = [f"--nats-{name}" for name in ("token", "user", "creds") if getattr(args, f"nats_{name}")]
    if given:
        return (f"{', '.join(given)} need --nats-url: the embedded NATS has a user per role (bus clients: "
                f"user {BUS_API}; --nats-password fixes its password)")  # fmt: skip
    if len(tls) == 1:
        return "--nats-tls-cert and --nats-tls-key go together"
    for path in (args.nats_tls_cert, args.nats_tls_key, args.nats_tls_ca):
        if path and not os.access(path, os.R_OK):
            return f"{path} (NATS TLS) is not a readable file"
    return None


def _bad_cluster(args: argparse.Namespace) -> str | None:
    """Why --nats-cluster / --nats-replicas cannot work, or None."""
    n = args.nats_cluster
    if n != 1 and (n < 3 or n % 2 == 0):  # JetStream needs a majority: 2 nodes survive no loss
        return f"--nats-cluster must be 1 or an odd number from 3, got {n}"
    if n > 1 and args.nats_url is not None:
        return "--nats-cluster starts an embedded cluster: leave out --nats-url (or --nats-cluster)"
    if args.nats_url is None and _replicas(args) > n:
        return f"--nats-replicas {args.nats_replicas} needs as many NATS nodes (--nats-cluster), got {n}"
    return None


def _replicas(args: argparse.Namespace) -> int:
    """Nodes that keep each work-queue message: --nats-replicas, else 3 in an embedded cluster, else 1."""
    if args.nats_replicas:
        return args.nats_replicas
    return min(CLUSTER_REPLICAS, args.nats_cluster) if args.nats_url is None else 1


def _start_nats(args: argparse.Namespace, prefix: str) -> tuple[NatsCluster, RoleUsers, str]:
    """The embedded NATS (one node, or a cluster) with a user per role, new passwords but the bus-api
    one given (--nats-password), which is else written to its file; and what bus clients need to know."""
    roles = RoleUsers.generate(prefix, args.nats_password)
    nats = NatsCluster(args.nats_cluster, args.nats_port, users=roles, preexec_fn=die_with_parent(),
                       tls_cert=args.nats_tls_cert, tls_key=args.nats_tls_key).start()  # fmt: skip
    note = f"bus clients: user {BUS_API}, "
    if args.nats_password:
        note += "the password you gave"
    else:
        note += f"password in {_write_password_file(roles.passwords[BUS_API], args.nats_port)}"
    if args.nats_tls_cert:
        note += f"; TLS with {args.nats_tls_cert}"
    return nats, roles, note


def password_file(port: int) -> str:
    """Where the bus-api user's password goes: `nats-bus-api-password` for the default port,
    `nats-bus-api-password-<port>` for another, so a second server (a benchmark's, say) does not
    overwrite the password of one still running."""
    from shared.model_files import cache_root

    name = "nats-bus-api-password" + ("" if port == DEFAULT_NATS_PORT else f"-{port}")
    return os.path.join(cache_root(), name)


def _write_password_file(password: str, port: int) -> str:
    path = password_file(port)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # a private temp file renamed over the old one: never readable by others, never half-written,
    # and a symlink planted at `path` is replaced, not followed
    fd, tmp = tempfile.mkstemp(prefix=".nats-bus-api-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    os.replace(tmp, path)
    return path


def _forget_password(password: str, port: int) -> None:
    """At exit, the password file goes if it still holds this server's password (a later server's
    stays)."""
    path = password_file(port)
    with contextlib.suppress(OSError):
        with open(path) as f:
            if f.read().strip() != password:
                return
        os.remove(path)


def _flags(values: dict) -> list[str]:
    out = []
    for k, v in values.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out
