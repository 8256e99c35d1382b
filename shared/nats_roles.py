"""Least privilege on the bus: one NATS user per role, allowed only the subjects that role uses.

A bus-API client may ask `<prefix>.api.>` and read the replies on its inbox, nothing else: it cannot read
the prompts on the work queue or the outputs of other gateways, forge a heartbeat, abort, or touch the
JetStream stream. A detokenizer cannot publish requests; a gateway cannot take work off the queue.

This table is the one source. `sglbus serve` writes it into its embedded NATS's config with passwords
it generates (EmbeddedNats); `deploy/nats.conf` (compose) is this module's output, passwords read from
nats-server's environment (`python -m shared.nats_roles > deploy/nats.conf`, checked by
tests/unit/test_nats_roles.py); docs/deploy.md shows it for a NATS of your own.

Subjects besides the deployment's own (`<prefix>.…`, shared/transport.py `Subjects`):
  _INBOX.>           replies: nats-py's request inboxes, the bus API's stream inboxes
  _SGLBUS_SYNC.>     the round trip that makes a subscribe live before it returns (NatsTransport._sync);
                     nobody may subscribe there, the server answers "no responders" itself
  _SGLBUS_WORK.>     where JetStream pushes the work queue's deliveries (one token per lane, so no
                     narrower pattern names them): the schedulers only
  $JS.API.…, $JS.ACK JetStream's API for the one work-queue stream, and its acknowledgements
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.nats_server import NATS_CONF, check_secret
from shared.nats_transport import work_stream_name
from shared.transport import Subjects, work_lane

GATEWAY, SCHEDULER, DETOKENIZER, BUS_API = "gateway", "scheduler", "detokenizer", "bus-api"
ROLES = (GATEWAY, SCHEDULER, DETOKENIZER, BUS_API)  # also the NATS user names
DEFAULT_PREFIX = "sglbus"
INBOX = "_INBOX.>"
SYNC = "_SGLBUS_SYNC.>"  # NatsTransport._sync
WORK_DELIVERIES = "_SGLBUS_WORK.>"  # nats_transport._deliver_subject


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # may answer each request it receives once, whatever its reply subject (a scheduler's ctl answers)
    responses: bool = False


def permissions(role: str, prefix: str = DEFAULT_PREFIX) -> Permissions:
    """What `role` may publish and subscribe to in the deployment of `prefix`."""
    s = Subjects(prefix)
    stream = work_stream_name(s.req)
    api = "$JS.API"
    # every service checks JetStream at start (check_jetstream) and makes the stream if it is missing
    service = (f"{api}.INFO", SYNC)
    ensure_stream = (f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.UPDATE.{stream}")
    heartbeat = s.ctl("heartbeat")
    table = {
        GATEWAY: Permissions(
            publish=(
                s.req,
                work_lane(s.req, "*"),
                s.abort,
                s.route_notes,
                s.ctl(">"),
                INBOX,
                f"$JS.ACK.{stream}.>",  # a request's final output settles its work item (settle_work)
                *ensure_stream,
                f"{api}.STREAM.MSG.DELETE.{stream}",
                # the router's claims on new prefixes (shared/nats_claims.py: a key-value bucket)
                f"{api}.STREAM.CREATE.KV_{s.claims}",
                f"$KV.{s.claims}.>",
                f"{api}.STREAM.MSG.GET.KV_{s.claims}",
                f"{api}.DIRECT.GET.KV_{s.claims}.>",
                *service,
            ),
            subscribe=(s.out("*"), f"{prefix}.api.>", s.kv_events("*"), s.route_notes, heartbeat, INBOX),
        ),
        SCHEDULER: Permissions(
            publish=(
                s.detok("*"),
                s.kv_events("*"),
                heartbeat,
                f"$JS.ACK.{stream}.>",
                *ensure_stream,
                f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>",  # nats-py's add_consumer for a durable
                f"{api}.CONSUMER.CREATE.{stream}.>",  # the same, where a consumer config carries a name
                f"{api}.CONSUMER.DELETE.{stream}.>",
                *service,
            ),
            subscribe=(WORK_DELIVERIES, s.abort, s.ctl(">"), INBOX),
            responses=True,
        ),
        DETOKENIZER: Permissions(
            publish=(s.out("*"), s.abort, heartbeat, *service),
            subscribe=(s.detok("*"), INBOX),
        ),
        BUS_API: Permissions(publish=(f"{prefix}.api.>", SYNC), subscribe=(INBOX,)),
    }
    if role not in table:
        raise ValueError(f"unknown NATS role {role!r}; the roles are {', '.join(ROLES)}")
    return table[role]


def password_env(role: str) -> str:
    """The environment variable that holds a role's password where nats-server reads it (compose)."""
    return f"SGLBUS_NATS_{role.upper().replace('-', '_')}_PASSWORD"


def authorization(prefix: str = DEFAULT_PREFIX, passwords: Mapping[str, str] | None = None) -> str:
    """The nats-server `authorization` block: one user per role with its permissions. `passwords`
    (role -> password) are written in; without them each is a bare `$SGLBUS_NATS_<ROLE>_PASSWORD`,
    which nats-server takes from its environment."""
    lines = ["authorization {", "  users: ["]
    for role in ROLES:
        perms = permissions(role, prefix)
        password = f"${password_env(role)}" if passwords is None else _quote(passwords[role])
        lines += [
            "    {",
            f"      user: {_quote(role)}",
            f"      password: {password}",
            "      permissions: {",
        ]
        for what, subjects in (("publish", perms.publish), ("subscribe", perms.subscribe)):
            lines += [f"        {what}: [", *(f"          {_quote(s)}" for s in subjects), "        ]"]
        if perms.responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    return "\n".join([*lines, "  ]", "}", ""])


def _quote(value: str) -> str:
    return f'"{value}"'  # quoted: `$JS.API…` is a subject, not a variable


@dataclass(frozen=True)
class RoleUsers:
    """The users of one deployment with their passwords (`sglbus serve`: new ones at each start)."""

    prefix: str = DEFAULT_PREFIX
    passwords: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        missing = [role for role in ROLES if role not in self.passwords]
        if missing:
            raise ValueError(f"no NATS password for the role(s) {', '.join(missing)}")
        for role in ROLES:
            check_secret(f"password of {role}", self.passwords[role])

    @classmethod
    def generate(cls, prefix: str = DEFAULT_PREFIX, bus_api_password: str | None = None) -> RoleUsers:
        """New random passwords; the bus API's may be given (`sglbus serve --nats-password`)."""
        passwords = {role: secrets.token_urlsafe(24) for role in ROLES}
        if bus_api_password:
            passwords[BUS_API] = bus_api_password
        return cls(prefix, passwords)

    def config(self) -> str:
        return authorization(self.prefix, self.passwords)

    def env(self, role: str) -> dict[str, str]:
        """The environment a service of `role` connects with (shared/service_main.py reads it)."""
        return {"SGLBUS_NATS_USER": role, "SGLBUS_NATS_PASSWORD": self.passwords[role]}


def compose_config(prefix: str = DEFAULT_PREFIX) -> str:
    """deploy/nats.conf: NATS's settings for compose, the passwords from nats-server's environment."""
    env = "\n# ".join(f"  {password_env(role)}: the {role}'s" for role in ROLES)
    option = "" if prefix == DEFAULT_PREFIX else f" --prefix {prefix}"
    header = f"""\
# NATS server settings for sglbus under compose (compose.yaml mounts this file).
# Generated by `python -m shared.nats_roles{option}` from shared/nats_roles.py, for the subject prefix
# {prefix!r}: edit the table there, not this file.
#
# Bulk prompt logprobs make messages of several MB; NATS' default max_payload is 1 MB. 64 MB is NATS'
# ceiling. sglbus reads the server's actual value: a step's output is split by request to fit.
#
# One user per role, each allowed only its subjects. A bare $NAME is taken from nats-server's
# environment; quoted, it would be the literal text. A value must not look like a number nor start
# with "-": `openssl rand -hex 32` makes a good one. The passwords:
# {env}
"""
    return header + NATS_CONF + authorization(prefix)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m shared.nats_roles", description=compose_config.__doc__)
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="the subject prefix (default: sglbus)")
    sys.stdout.write(compose_config(p.parse_args(argv).prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
