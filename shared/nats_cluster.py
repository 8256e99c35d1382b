"""A NATS cluster of embedded nats-servers on loopback (`sglbus serve --nats-cluster N`, tests): each node
runs JetStream with its own store, and routes join them, so a work queue replicated on three nodes keeps
what it stored, and keeps taking more, while any one node is down.

Clients list every node (`url`, comma-joined) and reconnect to a live one by themselves; every node
requires the clients' token or users (and TLS) as EmbeddedNats does. The routes have a user and password
of their own, new for each cluster: a route sees every message, so a local process that could join as
one would bypass the clients' permissions (shared/nats_roles.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.nats_server import EmbeddedNats, PortInUse, free_port, port_in_use

if TYPE_CHECKING:
    from shared.nats_roles import RoleUsers

CLUSTER_NAME = "sglbus"
ROUTE_USER = "route"
# with client ports from p, the route ports are from p + ROUTE_PORT_OFFSET
ROUTE_PORT_OFFSET = 100
# JetStream in a cluster needs each node named. no_advertise: the clients' URL lists name every node.
_NODE_CONFIG = """server_name: {name}-{i}
cluster {{
  name: {name}
  listen: {listen}
  authorization {{ user: "{user}", password: "{password}" }}
  routes: [{routes}]
  no_advertise: true
}}
"""


class NatsCluster:
    """`size` nodes (EmbeddedNats), node i with the client port `port + i` and the route port
    `route_port + i` (default `port + ROUTE_PORT_OFFSET`); `port=None` takes free ports (tests). `start`
    returns once JetStream answers through every node. A cluster of one is a plain EmbeddedNats: no
    routes, ready once its port is open."""

    def __init__(
        self,
        size: int = 3,
        port: int | None = None,
        route_port: int | None = None,
        host: str = "127.0.0.1",
        start_timeout: float = 30.0,
        token: str | None = None,
        users: RoleUsers | None = None,
        preexec_fn: Callable[[], None] | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a NATS cluster needs at least one node, got {size}")
        if route_port is None and port is not None:
            route_port = port + ROUTE_PORT_OFFSET
        self.host, self.start_timeout = host, start_timeout
        self.route_ports = [None if route_port is None else route_port + i for i in range(size)]
        ports = [None if port is None else port + i for i in range(size)]
        self.route_password = secrets.token_urlsafe(24)
        self.nodes = [EmbeddedNats(p, host, start_timeout, token, users, preexec_fn, tls_cert=tls_cert,
                                   tls_key=tls_key) for p in ports]  # fmt: skip

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-joined: what a client (NatsTransport.connect, --nats-url) is given."""
        return ",".join(self.urls)

    def start(self) -> NatsCluster:
        clustered = len(self.nodes) > 1
        if clustered:
            self._configure_routes()
        try:
            for node in self.nodes:
                node.start()
            if clustered:
                self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _configure_routes(self) -> None:
        ports = [p if p is not None else free_port(self.host) for p in self.route_ports]
        for p in (p for p, given in zip(ports, self.route_ports, strict=True) if given is not None):
            if port_in_use(self.host, p):  # nats-server would exit naming no port
                raise PortInUse(f"route port {p} on {self.host} is in use by another process")
        self.route_ports = ports
        at = f"nats-route://{ROUTE_USER}:{self.route_password}@{self.host}"
        for i, node in enumerate(self.nodes):
            routes = ", ".join(f"{at}:{p}" for j, p in enumerate(ports) if j != i)
            node.extra_config = _NODE_CONFIG.format(
                name=CLUSTER_NAME, i=i + 1, listen=f"{self.host}:{ports[i]}", routes=routes,
                user=ROUTE_USER, password=self.route_password,
            )  # fmt: skip

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until JetStream answers through every running node (one killed is left out): the routes are
        up and a majority elected a meta leader, so a replicated stream can be made. RuntimeError, with
        the nodes' log tails, past `timeout` (default: the start timeout)."""
        deadline = time.monotonic() + (timeout or self.start_timeout)
        for node in (node for node in self.nodes if node.proc is not None):
            while not asyncio.run(_jetstream_answers(node)):
                if node.exit_code() is not None or time.monotonic() > deadline:
                    tails = "".join(f"\n--- {n.url} ---\n{n.log_tail()}" for n in self.nodes)
                    raise RuntimeError(f"NATS cluster not up: no JetStream at {node.url}; logs:{tails}")
                time.sleep(0.2)

    def kill(self, i: int) -> None:
        """Node i dies by SIGKILL (no flush, no goodbye); `restart(i)` brings it back."""
        self.nodes[i].kill()

    def restart(self, i: int, downtime: float = 0.0) -> None:
        """Node i (stopped first if it runs) starts again on its ports and store and rejoins the cluster."""
        self.nodes[i].restart(downtime)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _jetstream_answers(node: EmbeddedNats) -> bool:
    """One JetStream API call through this node: it answers once the cluster has a meta leader."""
    import nats  # here: `sglbus serve` imports this module and starts no client of its own otherwise
    import nats.errors
    import nats.js.errors

    async def quiet(e: Exception) -> None:  # a node still starting refuses: expected, not worth a traceback
        pass

    try:
        nc = await nats.connect(node.url, connect_timeout=1, allow_reconnect=False, error_cb=quiet,
                                **node.client_options())  # fmt: skip
    except (OSError, nats.errors.Error, TimeoutError):
        return False
    try:
        await nc.jetstream(timeout=1).account_info()
        return True
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
        return False
    finally:
        with contextlib.suppress(nats.errors.Error):
            await nc.close()
