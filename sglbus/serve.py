"""`sglbus serve`: an embedded NATS (unless --nats-url), then the scheduler, detokenizer and gateway as
processes; waits for /health, prints the URL, and on Ctrl-C / SIGTERM stops everything it started."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

from shared.config import EngineConfig, add_cli_args, cli_overrides
from shared.nats_server import EmbeddedNats

_STARTUP_TIMEOUT_S = 600.0  # a first start converts the GGUF and loads the model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglbus serve", description=__doc__)
    p.add_argument("--host", default=os.environ.get("SGLBUS_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("SGLBUS_PORT", "30000")))
    p.add_argument("--nats-url", default=os.environ.get("SGLBUS_NATS_URL"),
                   help="use this NATS server instead of starting one")  # fmt: skip
    add_cli_args(p, EngineConfig)
    return p.parse_args(argv)


def _flags(values: dict) -> list[str]:
    out = []
    for k, v in values.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = cli_overrides(args, EngineConfig)
    EngineConfig.from_env(**engine)  # fail fast on a bad option, before anything starts
    nats = None
    if args.nats_url is None:
        nats = EmbeddedNats().start()
        nats_url = nats.url
        print(f"embedded NATS (JetStream on) at {nats_url}", flush=True)
    else:
        nats_url = args.nats_url

    def pick(*names: str) -> dict:
        return {k: engine[k] for k in names if k in engine}

    common = pick("model_path", "tokenizer_path", "subject_prefix")
    commands = {
        "scheduler": ["services.scheduler", "--nats-url", nats_url, *_flags(engine)],
        "detokenizer": ["services.detokenizer", "--nats-url", nats_url,
                        *_flags({**common, **pick("worker_id")})],
        "gateway": ["services.gateway", "--nats-url", nats_url, "--host", args.host, "--port", str(args.port),
                    *_flags(common)],
    }  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for name, cmd in commands.items():
            procs[name] = subprocess.Popen([sys.executable, "-m", *cmd])
        url = f"http://{args.host}:{args.port}"
        if not _wait_healthy(url, procs, lambda: stopping):
            return 1
        print(f"sglbus is serving at {url}  (Ctrl-C stops it)", flush=True)
        while not stopping:
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                print(f"{', '.join(dead)} exited; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        _terminate(procs)
        if nats is not None:
            nats.stop()


def _wait_healthy(url: str, procs: dict[str, subprocess.Popen], stopping) -> bool:
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and not stopping():
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            print(f"{', '.join(dead)} failed to start", file=sys.stderr, flush=True)
            return False
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def _terminate(procs: dict[str, subprocess.Popen]) -> None:
    # gateway first (stop taking requests), then the pipeline behind it
    for name in ("gateway", "scheduler", "detokenizer"):
        if name in procs and procs[name].poll() is None:
            procs[name].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
