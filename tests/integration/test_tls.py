"""TLS on the bus and HTTPS for clients, with a self-signed certificate made here by the `openssl` CLI
(skipped without it): NATS requires TLS with `tls {}` (EmbeddedNats, `sglbus serve --nats-tls-cert`),
services trust it through a CA file (`--nats-tls-ca`), and the gateways serve HTTPS (`--ssl-certfile`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import nats
import orjson
import pytest
from conftest import ROOT

from shared.nats_cluster import NatsCluster
from shared.nats_roles import BUS_API, GATEWAY, ROLES, SCHEDULER, RoleUsers
from shared.nats_server import free_port
from shared.nats_transport import BusAuth, NatsTransport

START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(certificate, key): self-signed, for 127.0.0.1 and localhost."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    crt, key = str(folder / "cert.pem"), str(folder / "key.pem")
    make = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt,
            "-days", "2", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]  # fmt: skip
    subprocess.run(make, check=True, capture_output=True)
    return crt, key


def test_a_cluster_with_tls_and_users_comes_up_and_checks_its_certificate(cert: tuple[str, str]) -> None:
    crt, key = cert
    users = RoleUsers.generate()
    with NatsCluster(3, users=users, tls_cert=crt, tls_key=key) as cluster:  # ready: JetStream through TLS

        async def connect(role: str, tls_ca: str | None) -> None:
            auth = BusAuth(user=role, password=users.passwords[role], tls_ca=tls_ca)
            bus = await NatsTransport.connect(cluster.url, role, 10, auth, stream_replicas=3)
            try:
                if role != BUS_API:
                    await bus.check_jetstream(cluster.url, patience=10)
            finally:
                await bus.close()

        for role in ROLES:
            asyncio.run(connect(role, crt))
        t0 = time.monotonic()
        with pytest.raises(PermissionError, match="TLS failed"):  # the system's CAs do not know it
            asyncio.run(connect(SCHEDULER, None))
        assert time.monotonic() - t0 < 5  # said at once, not after the connect timeout
        with pytest.raises(ValueError, match="NATS TLS CA file"):
            asyncio.run(connect(GATEWAY, "/nonexistent/ca.pem"))


def test_a_certificate_that_does_not_load_is_one_line_and_exit_2(tmp_path) -> None:
    bad = tmp_path / "not-a-cert.pem"
    bad.write_text("not a certificate\n")
    cmd = [sys.executable, "-m", "services.gateway", "--nats-url", f"nats://127.0.0.1:{free_port()}",
           "--port", str(free_port()), "--ssl-certfile", str(bad), "--ssl-keyfile", str(bad)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot serve HTTPS with" in lines[0], r.stderr


@pytest.fixture(scope="module")
def served_tls(cert: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """`sglbus serve` with TLS on its NATS and HTTPS on its port."""
    crt, key = cert
    port, nats_port, logs = free_port(), free_port(), tmp_path_factory.mktemp("serve")
    cmd = [sys.executable, "-m", "sglbus.cli", "serve", "--port", str(port), "--nats-port", str(nats_port),
           "--max-total-tokens", "16384", "--tokenizer-worker-num", "1", "--ssl-certfile", crt,
           "--ssl-keyfile", key, "--nats-tls-cert", crt, "--nats-tls-key", key]  # fmt: skip
    out, err = logs / "serve.out", logs / "serve.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                start_new_session=True)  # fmt: skip
    s = {"url": f"https://127.0.0.1:{port}", "nats": f"nats://127.0.0.1:{nats_port}", "cert": crt,
         "out": out, "err": err, "port": port}  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while f"sglbus is serving at {s['url']}" not in out.read_text():
            assert proc.poll() is None, f"serve exited with {proc.returncode}\n{err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"not serving after {START_TIMEOUT_S} s\n{err.read_text()[-3000:]}"
            )
            time.sleep(0.3)
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
def test_serve_answers_https_with_its_certificate_and_not_plain_http(served_tls: dict) -> None:
    trust = ssl.create_default_context(cafile=served_tls["cert"])
    with httpx.Client(base_url=served_tls["url"], verify=trust, timeout=120) as https:
        assert https.get("/health").status_code == 200
        body = {
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        }
        r = https.post("/generate", json=body)
        assert r.status_code == 200 and r.json()["text"], r.text
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port gets no answer
        httpx.get(f"http://127.0.0.1:{served_tls['port']}/health", timeout=10)


@pytest.mark.slow
def test_bus_clients_reach_serves_nats_over_tls_as_the_bus_api_user(served_tls: dict) -> None:
    password_line = next(line for line in served_tls["out"].read_text().splitlines() if "password in" in line)
    path = password_line.split("password in ", 1)[1].split(";")[0]  # "... password in <path>; TLS with ..."
    with open(path) as f:
        password = f.read().strip()

    async def generate() -> str:
        tls = ssl.create_default_context(cafile=served_tls["cert"])
        nc = await nats.connect(served_tls["nats"], user=BUS_API, password=password, tls=tls)
        try:
            body = {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
            msg = await nc.request("sglbus.api.generate", orjson.dumps(body), timeout=120)
            return orjson.loads(msg.data)["text"]
        finally:
            await nc.close()

    assert asyncio.run(generate())
    assert "Permissions Violation" not in served_tls["err"].read_text()  # every role did its job
