"""The NATS permission table (shared/nats_roles.py) and the configs written from it: the embedded NATS's
(shared/nats_server.py, nats_cluster.py) and compose's (deploy/nats.conf), and how `sglbus serve` hands
each service its role."""

from __future__ import annotations

import os
import re

import pytest

from services.gateway.config import GatewayConfig
from shared.nats_cluster import NatsCluster
from shared.nats_roles import (
    BUS_API,
    DETOKENIZER,
    GATEWAY,
    ROLES,
    SCHEDULER,
    RoleUsers,
    compose_config,
    password_env,
    permissions,
)
from shared.nats_server import EmbeddedNats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVICES = (GATEWAY, SCHEDULER, DETOKENIZER)


def may(role: str, action: str, subject: str) -> bool:
    """Whether `role` may publish / subscribe to `subject` (NATS wildcards: `*` one token, `>` the rest)."""
    patterns = getattr(permissions(role), action)
    return any(_matches(p.split("."), subject.split(".")) for p in patterns)


def _matches(pattern: list[str], tokens: list[str]) -> bool:
    if pattern == [">"]:
        return bool(tokens)
    if not pattern or not tokens:
        return not pattern and not tokens
    return pattern[0] in ("*", tokens[0]) and _matches(pattern[1:], tokens[1:])


def test_deploy_nats_conf_is_the_table_for_compose() -> None:
    with open(os.path.join(ROOT, "deploy", "nats.conf")) as f:
        assert f.read() == compose_config(), "regenerate it: python -m shared.nats_roles > deploy/nats.conf"


def test_the_bus_api_may_only_ask_the_api_and_read_its_inbox() -> None:
    p = permissions(BUS_API)
    assert set(p.publish) == {"sglbus.api.>", "_SGLBUS_SYNC.>"} and p.subscribe == ("_INBOX.>",)
    assert not p.responses


def test_only_the_scheduler_reads_the_work_queue_and_only_the_gateway_fills_it_and_they_settle_it() -> None:
    readers = [r for r in ROLES if "_SGLBUS_WORK.>" in permissions(r).subscribe]
    writers = [r for r in ROLES if {"sglbus.req", "sglbus.req.*"} & set(permissions(r).publish)]
    ackers = [r for r in ROLES if any(s.startswith("$JS.ACK.") for s in permissions(r).publish)]
    # the scheduler keeps a request alive (and settles what it drops); the gateway settles it with its
    # final output
    assert readers == [SCHEDULER] and writers == [GATEWAY] and ackers == [GATEWAY, SCHEDULER]


def test_no_role_may_purge_or_delete_the_stream() -> None:
    for role in ROLES:
        for api in ("STREAM.PURGE.SGLBUS_REQ", "STREAM.DELETE.SGLBUS_REQ", "STREAM.LIST", "ACCOUNT.PURGE.x"):
            assert not may(role, "publish", f"$JS.API.{api}"), (role, api)
    assert may(GATEWAY, "publish", "$JS.API.STREAM.MSG.DELETE.SGLBUS_REQ")  # withdraw_work
    assert not may(BUS_API, "publish", "$JS.API.INFO")


def test_the_bus_api_cannot_read_prompts_or_outputs_nor_forge_what_services_send() -> None:
    services_only = ("sglbus.req", "sglbus.req.0", "_SGLBUS_WORK.SGLBUS_REQ", "sglbus.out.gw1",
                     "sglbus.detok.0", "sglbus.ctl.heartbeat", "sglbus.kv.0", "sglbus.route",
                     "sglbus.abort")  # fmt: skip
    for subject in services_only:
        assert not may(BUS_API, "subscribe", subject) and not may(BUS_API, "publish", subject), subject
    assert may(BUS_API, "publish", "sglbus.api.generate") and may(BUS_API, "subscribe", "_INBOX.abc.1")


def test_heartbeats_come_from_the_services_only() -> None:
    assert [r for r in ROLES if may(r, "publish", "sglbus.ctl.heartbeat")] == list(SERVICES)


def test_the_table_follows_the_subject_prefix() -> None:
    for role in ROLES:
        p = permissions(role, "model-b")
        subjects = (*p.publish, *p.subscribe)
        assert not any(s.startswith("sglbus.") or "SGLBUS_REQ" in s for s in subjects), (role, subjects)
    assert "$JS.API.STREAM.CREATE.MODEL_B_REQ" in permissions(GATEWAY, "model-b").publish
    assert "model-b.api.>" in permissions(BUS_API, "model-b").publish
    with pytest.raises(ValueError, match="unknown NATS role"):
        permissions("admin")


def test_compose_reads_each_password_from_the_environment() -> None:
    conf = compose_config()
    for role in ROLES:
        assert f"password: ${password_env(role)}\n" in conf
    assert password_env(BUS_API) == "SGLBUS_NATS_BUS_API_PASSWORD"
    assert "max_payload: 64MB" in conf


def test_the_embedded_config_has_every_user_with_its_generated_password() -> None:
    users = RoleUsers.generate("sglbus", bus_api_password="chosen-by-you")
    conf = EmbeddedNats(users=users).config_text()
    for role in ROLES:
        assert f'user: "{role}"\n      password: "{users.passwords[role]}"' in conf
    assert users.passwords[BUS_API] == "chosen-by-you"
    assert len({users.passwords[r] for r in SERVICES}) == 3 and "token:" not in conf
    assert users.passwords[GATEWAY] not in repr(users)  # no secret in a log line
    # what each service process is given (sglbus serve: the environment, never the command line)
    assert users.env(SCHEDULER) == {"SGLBUS_NATS_USER": "scheduler",
                                    "SGLBUS_NATS_PASSWORD": users.passwords[SCHEDULER]}  # fmt: skip


def test_bad_auth_settings_are_refused_before_a_server_starts() -> None:
    with pytest.raises(ValueError, match="without quotes"):
        RoleUsers.generate(bus_api_password='has"quote')
    with pytest.raises(ValueError, match="token or users"):
        EmbeddedNats(token="t", users=RoleUsers.generate())
    with pytest.raises(ValueError, match="go together"):
        EmbeddedNats(tls_cert="cert.pem")
    with pytest.raises(ValueError, match="no NATS password"):
        RoleUsers("sglbus", {GATEWAY: "x"})


def test_tls_and_the_probe_of_an_embedded_server(tmp_path) -> None:
    users = RoleUsers.generate()
    node = EmbeddedNats(users=users, tls_cert="cert.pem", tls_key="key.pem")
    cwd = os.getcwd()
    assert f'tls {{ cert_file: "{cwd}/cert.pem", key_file: "{cwd}/key.pem" }}' in node.config_text()
    probe = node.client_options()  # the cluster's readiness probe: the gateway's user, TLS unverified
    assert probe["user"] == GATEWAY and probe["password"] == users.passwords[GATEWAY] and "tls" in probe


def test_cluster_routes_need_their_own_password() -> None:
    cluster = NatsCluster(3, port=None, users=RoleUsers.generate())
    cluster._configure_routes()
    login = f"route:{cluster.route_password}@"
    for node in cluster.nodes:
        assert f'authorization {{ user: "route", password: "{cluster.route_password}" }}' in node.extra_config
        assert node.extra_config.count(f"nats-route://{login}127.0.0.1:") == 2
    assert NatsCluster(3).route_password != cluster.route_password


def test_serve_refuses_what_the_embedded_nats_cannot_take(tmp_path) -> None:
    from sglbus.serve import _bad_nats_auth, build_parser

    def why(*argv: str) -> str | None:
        return _bad_nats_auth(build_parser().parse_args(list(argv)))

    assert "need --nats-url" in why("--nats-token", "t")
    assert "need --nats-url" in why("--nats-user", "u", "--nats-password", "p")
    assert why("--nats-password", "fixed") is None  # the bus-api user's password
    assert "go together" in why("--nats-tls-cert", "cert.pem")
    assert "not a readable file" in why("--nats-tls-cert", "nope.pem", "--nats-tls-key", "nope.key")
    url = ("--nats-url", "nats://x:4222")
    assert "leave out --nats-url" in why(*url, "--nats-tls-cert", "c", "--nats-tls-key", "k")
    assert why(*url, "--nats-token", "t", "--nats-tls-ca", "ca.pem") is None


def test_https_needs_both_a_readable_certificate_and_key(tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    assert GatewayConfig(ssl_certfile=str(cert), ssl_keyfile=str(key)).ssl_keyfile == str(key)
    with pytest.raises(ValueError, match="go together"):
        GatewayConfig(ssl_certfile=str(cert))
    with pytest.raises(ValueError, match="ssl_keyfile .* is not a readable file"):
        GatewayConfig(ssl_certfile=str(cert), ssl_keyfile=str(tmp_path / "missing.pem"))


def test_the_table_in_docs_deploy_md_is_the_table() -> None:
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        rows = {line.split("|")[1].strip(" `"): line.split("|")[2:4] for line in f if line.startswith("| `")}
    for role in ROLES:
        publish, subscribe = (set(re.findall(r"`([^`]+)`", cell)) for cell in rows[role])
        p = permissions(role)
        assert publish == set(p.publish) and subscribe == set(p.subscribe), role
