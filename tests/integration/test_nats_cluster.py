"""A NATS cluster of three real nodes (shared/nats_cluster.py) losing one by SIGKILL: the work queue, kept
on all three (R3), loses nothing it accepted, and the served system keeps answering.

When the node that leads the stream dies, the other two elect a new leader within a few seconds; a
publish in between is refused (nothing was stored) and succeeds once the leader is there.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import nats.errors
import nats.js.errors
import pytest
from conftest import ServerProcs, start_server
from it_helpers import PROMPT, generate, greedy, same_output
from nats.js.api import StreamInfo

from sglbus.supervisor import Supervisor
from shared.nats_cluster import NatsCluster
from shared.nats_transport import BusAuth, NatsTransport, work_stream_name
from shared.transport import ACK, BusUnavailable, Message

pytestmark = pytest.mark.slow

TOKEN = "cluster-test-token"
SUBJECT = "t.cluster.work"
# a delivery lost with its node comes back after this long
ACK_WAIT_S = 3.0
# how long anything may take to come back after a node died: a new leader, a redelivery (generous: a
# busy 2-core box; nothing here asserts a time, this only bounds a wait)
RECOVERY_S = 60.0


@pytest.fixture
def cluster() -> Iterator[NatsCluster]:
    with NatsCluster(3, token=TOKEN) as c:
        yield c


async def connect(cluster: NatsCluster, name: str) -> NatsTransport:
    return await NatsTransport.connect(cluster.url, name, auth=BusAuth(token=TOKEN), stream_replicas=3)


async def leader(bus: NatsTransport, consumer: str | None = None) -> int:
    """The index of the node that leads the work-queue stream (or one of its consumers)."""
    stream = work_stream_name(SUBJECT)
    info = await (bus.js.consumer_info(stream, consumer) if consumer else bus.js.stream_info(stream))
    return node_index(info.cluster.leader)


def node_index(name: str) -> int:
    return int(name.rsplit("-", 1)[1]) - 1  # NatsCluster names its nodes sglbus-1, sglbus-2, ...


async def publish_until_stored(bus: NatsTransport, data: bytes) -> None:
    """publish_work, again while it is refused (no leader yet): a refused message was not stored."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        try:
            await bus.publish_work(SUBJECT, data)
            return
        except BusUnavailable:
            assert time.monotonic() < deadline, f"{data!r} not stored within {RECOVERY_S} s of a node's death"
            await asyncio.sleep(0.2)


async def wait_until(cond: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + RECOVERY_S
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {RECOVERY_S} s"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_connect_takes_any_live_node_with_the_token_in_the_urls(cluster: NatsCluster) -> None:
    """With the first node down, a client given every node (the token in the URLs, one URL without a
    scheme) connects to a live one; when that one dies too, it moves to the last."""
    cluster.kill(0)
    first, second, third = (url.removeprefix("nats://") for url in cluster.urls)
    url = f"nats://{TOKEN}@{first},{TOKEN}@{second},nats://{TOKEN}@{third}"
    bus = await NatsTransport.connect(url, "probe", connect_timeout=10)
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on(msg: Message) -> None:
        await got.put(msg.data)

    try:
        ports = [node.port for node in cluster.nodes]
        on_node = ports.index(bus.nc.connected_url.port)
        assert on_node != 0
        await bus.subscribe("t.cluster.echo", on)
        await asyncio.to_thread(cluster.kill, on_node)
        await wait_until(lambda: bus.reconnects and bus.is_connected, "reconnected to the last node")
        assert bus.nc.connected_url.port == ports[3 - on_node]
        await bus.publish("t.cluster.echo", b"still here")
        assert await asyncio.wait_for(got.get(), 10) == b"still here"  # its subscription moved along
    finally:
        await bus.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("victim", ["stream leader", "consumer leader"])
async def test_work_queue_loses_nothing_when_a_node_dies(cluster: NatsCluster, victim: str) -> None:
    """300 messages, a node killed after the first 100: every message published is delivered, and the
    node, restarted, rejoins the cluster, which takes more."""
    worker, pub = await connect(cluster, "worker"), await connect(cluster, "pub")
    got: list[bytes] = []

    async def on(msg: Message) -> None:
        got.append(msg.data)
        await worker.settle_work(msg.work.token, ACK)

    try:
        await worker.subscribe_work(SUBJECT, "g", on, ack_wait=ACK_WAIT_S)
        sent = [f"m{i}".encode() for i in range(300)]
        for i, data in enumerate(sent):
            if i == 100:
                node = await leader(pub, "g" if victim == "consumer leader" else None)
                await asyncio.to_thread(cluster.kill, node)
            await publish_until_stored(pub, data)
        await wait_until(lambda: set(sent) <= set(got), "every stored message delivered")
        assert set(got) == set(sent)  # duplicates may come (an ack lost with the node), nothing else

        await asyncio.to_thread(cluster.restart, node)
        more = [f"after-restart-{i}".encode() for i in range(20)]
        for data in more:
            await publish_until_stored(pub, data)
        await wait_until(lambda: set(more) <= set(got), "messages after the restart delivered")
    finally:
        await pub.close()
        await worker.close()


def test_serve_restarts_a_dead_node_which_rejoins(cluster: NatsCluster) -> None:
    """`sglbus serve`'s supervisor restarts a node that died, on its port, and it rejoins the cluster
    (JetStream answers through it again); the others are left alone."""
    sup = Supervisor([], cluster)
    victim, others = cluster.nodes[1], [cluster.nodes[0], cluster.nodes[2]]
    pids, port = [n.proc.pid for n in others], victim.port
    died = victim.proc.pid
    victim.proc.kill()
    deadline = time.monotonic() + RECOVERY_S
    while victim.proc is None or victim.proc.pid == died:
        assert time.monotonic() < deadline, "the dead node was not restarted"
        sup.tend()
        time.sleep(0.05)
    assert victim.port == port and [n.proc.pid for n in others] == pids
    cluster.wait_ready(RECOVERY_S)


# -- the served system ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clustered() -> Iterator[ServerProcs]:
    # a lost ack or restart signal (its node died) is redelivered after ack_wait: short, to keep the test
    # short, yet over the few seconds a new leader takes (the gateway gives up on a request no scheduler
    # has known for twice this long)
    # a small KV pool: the suite runs this beside other servers on a 24 GiB machine
    s = start_server(env={"SGLBUS_REQUEST_ACK_WAIT": "10"}, scheduler_args=["--max-total-tokens", "4096"],
                     nats_nodes=3)  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def post_json(url: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=180) as http:
        return http.post("/generate", json=body)


def requests(n: int) -> list[dict[str, Any]]:
    return [
        {"text": f"{PROMPT} number {i}:", "sampling_params": greedy(16, ignore_eos=True),
         "rid": f"cluster-{uuid.uuid4().hex[:6]}-{i}"}
        for i in range(n)
    ]  # fmt: skip


async def request_stream(s: ServerProcs, empty: bool = False) -> StreamInfo:
    """The request stream's state, once it has a leader (asking waits through an election) and, with
    `empty`, holds no message: every request was acknowledged, none is left to come back (an
    acknowledgement lost with its node makes the request come back after ack_wait, and the gateway
    settles it then)."""
    nc = await NatsTransport.connect(s.nats_url, "test-probe", auth=BusAuth(token=s.nats_token))
    try:
        deadline = time.monotonic() + RECOVERY_S
        while True:
            try:
                info = await nc.js.stream_info(work_stream_name("sglbus.req"))
                if not (empty and info.state.messages):
                    return info
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"the request stream: no leader, or not empty\n{s.tails()}"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


def held(s: ServerProcs) -> int:
    """Requests the scheduler runs or queues."""
    r = s.http.get("/get_server_info")
    if r.status_code != 200:
        return 0
    info = r.json()
    return info["num_running_reqs"] + info["num_queue_reqs"]


def in_flight_while_killed(s: ServerProcs, bodies: list[dict[str, Any]], node: int) -> list[httpx.Response]:
    """The bodies' answers, posted at once, with NATS node `node` killed (SIGKILL) once every one of them
    was accepted (the scheduler holds it, or it is done): one still on its way into the work queue
    could be refused while the stream elects a leader."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        futs = [pool.submit(post_json, s.url, b) for b in bodies]
        deadline = time.monotonic() + RECOVERY_S
        while held(s) + sum(f.done() for f in futs) < len(bodies):
            assert time.monotonic() < deadline, f"requests not accepted\n{s.tails()}"
            time.sleep(0.05)
        s.cluster.kill(node)
        return [f.result(timeout=180) for f in futs]


def test_served_requests_complete_when_a_nats_node_dies(clustered: ServerProcs) -> None:
    """12 JSON requests in flight when a node dies by SIGKILL, each node in turn (the one leading the
    request stream first; a service connected to the dead node moves to another): every request gets
    its 200 with exactly the output of a healthy server, and so do the requests after."""
    s = clustered
    bodies = requests(12)
    stream = asyncio.run(request_stream(s))
    assert stream.config.num_replicas == 3  # SGLBUS_NATS_REPLICAS reached the services
    first = node_index(stream.cluster.leader)
    answers = []
    for node in [first, *(i for i in range(3) if i != first)]:
        results = in_flight_while_killed(s, [{**b, "rid": f"{b['rid']}-{node}"} for b in bodies], node)
        for body, r in zip(bodies, results, strict=True):
            assert r.status_code == 200, f"{body['rid']}: {r.status_code} {r.text}\n{s.tails()}"
        answers.append(results)
        # back, as `sglbus serve` restarts it. A request published while the stream has no leader
        # yet is refused with a 503 (publish_work gives up at once): wait for the leader, and for
        # the requests that come back for nobody, which would count as held in the next round.
        s.cluster.restart(node)
        s.cluster.wait_ready(RECOVERY_S)
        asyncio.run(request_stream(s, empty=True))
    for body, *results in zip(bodies, *answers, strict=True):
        ref = generate(s.http, {k: v for k, v in body.items() if k != "rid"})
        assert all(same_output(r.json(), ref) for r in results), body["rid"]
    s.settle(RECOVERY_S)
