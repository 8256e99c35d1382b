"""The per-role NATS users (shared/nats_roles.py) on a real nats-server: each service role can do its
whole job over NatsTransport, without one permission violation, and the bus-API user can ask
`<prefix>.api.>` and read its replies but cannot read prompts or outputs, forge heartbeats or requests,
or purge the work queue."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import nats
import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio

from shared.nats_roles import BUS_API, DETOKENIZER, GATEWAY, ROLES, SCHEDULER, RoleUsers, password_env
from shared.nats_server import EmbeddedNats, free_port, nats_server_binary, wait_for_port
from shared.nats_transport import BusAuth, NatsTransport, work_stream_name
from shared.transport import ACK, PROGRESS, Message, Subjects, Transport

pytestmark = pytest.mark.asyncio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIX = "permtest"
S = Subjects(PREFIX)
STREAM = work_stream_name(S.req)
QUIET_S = 0.5  # how long a message that must not arrive is waited for


@pytest.fixture(scope="module")
def roles() -> RoleUsers:
    return RoleUsers.generate(PREFIX)


@pytest.fixture(scope="module")
def server(roles: RoleUsers) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(users=roles) as server:
        yield server


@pytest_asyncio.fixture
async def bus(server: EmbeddedNats, roles: RoleUsers) -> AsyncIterator[Callable[[str], Awaitable[Transport]]]:
    """bus(role) -> a NatsTransport connected as that role's user, as the services connect."""
    opened: list[NatsTransport] = []

    async def connect(role: str) -> Transport:
        auth = BusAuth(user=role, password=roles.passwords[role])
        opened.append(await NatsTransport.connect(server.url, f"test-{role}", 10, auth))
        return opened[-1]

    yield connect
    for t in reversed(opened):
        await t.close()


class Client:
    """A bus-API client as a user writes one: plain nats-py, its permission errors collected."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, server: EmbeddedNats, password: str) -> Client:
        self.nc = await nats.connect(server.url, user=BUS_API, password=password, error_cb=self.on_error)
        return self

    async def on_error(self, e: Exception) -> None:
        self.errors.append(str(e).lower())

    async def refused(self, what: str, subject: str) -> bool:
        """Whether the server answered `what` (publish, subscription) on `subject` with a violation."""
        deadline = time.monotonic() + 5
        needle = f"permissions violation for {what} to"
        while not any(needle in e and subject.lower() in e for e in self.errors):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True


@pytest_asyncio.fixture
async def client(server: EmbeddedNats, roles: RoleUsers) -> AsyncIterator[Client]:
    c = await Client().connect(server, roles.passwords[BUS_API])
    yield c
    await c.nc.close()


def collect(into: list[Message]) -> Callable[[Message], Awaitable[None]]:
    async def handler(msg: Message) -> None:
        into.append(msg)

    return handler


async def until(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)


def violations(server: EmbeddedNats) -> list[str]:
    return [line for line in server.log_tail(10_000).splitlines() if "Violation" in line]


async def test_each_role_does_its_job(bus, client: Client, server: EmbeddedNats) -> None:
    before = len(violations(server))
    gateway, scheduler, detokenizer = await bus(GATEWAY), await bus(SCHEDULER), await bus(DETOKENIZER)
    work, detok, out, aborts, beats, kv, notes = [], [], [], [], [], [], []
    # the scheduler: the work queue's shared lane and its own, aborts, heartbeats, ctl requests
    await scheduler.subscribe_work(S.req, "schedulers", collect(work), ack_wait=30)
    await scheduler.subscribe_work(S.req, "schedulers", collect(work), ack_wait=30, key="0")
    await scheduler.subscribe(S.abort, collect(aborts))

    async def answer(m: Message) -> None:
        await scheduler.publish(m.reply, b"info")  # a reply to the gateway's inbox (allow_responses)

    await scheduler.subscribe(S.ctl("server_info"), answer, queue="schedulers")
    await scheduler.subscribe(S.ctl_all("server_info"), answer)
    await detokenizer.subscribe(S.detok("0"), collect(detok))
    await gateway.subscribe(S.out("gw1"), collect(out))
    await gateway.subscribe(S.ctl("heartbeat"), collect(beats))
    await gateway.subscribe(S.kv_events("*"), collect(kv))
    await gateway.subscribe(S.route_notes, collect(notes))

    # a request into each lane; the scheduler keeps them alive and acknowledges one, the gateway the
    # other (a request's final output settles its work item: RequestManager._on_text)
    for key in (None, "0"):
        await gateway.publish_work(S.req, b"prompt", key)
    await until(lambda: len(work) == 2, "both work-queue deliveries")
    for m in work:
        await scheduler.settle_work(m.work.token, PROGRESS)
    await scheduler.settle_work(work[0].work.token, ACK)
    await gateway.settle_work(work[1].work.token, ACK)
    # a request routed to a worker that died is taken back by the gateway
    receipt = await gateway.publish_work(S.req, b"stranded", "9")
    assert await gateway.withdraw_work(S.req, receipt)

    await scheduler.publish(S.detok("0"), b"tokens")
    await detokenizer.publish(S.out("gw1"), b"text")
    await detokenizer.publish(S.abort, b"stop")
    await gateway.publish(S.abort, b"abort")
    for t in (gateway, scheduler, detokenizer):
        await t.publish(S.ctl("heartbeat"), b"beat")
    await scheduler.publish(S.kv_events("0"), b"events")
    await gateway.publish(S.route_notes, b"note")
    assert await gateway.request(S.ctl("server_info"), b"", timeout=5) == b"info"
    inbox, answers = gateway.new_inbox(), []  # the fan-out to every scheduler (services/gateway/fanout.py)
    await gateway.subscribe(inbox, collect(answers))
    await gateway.publish(S.ctl_all("server_info"), b"", reply=inbox)
    await until(lambda: detok and out and len(aborts) == 2 and len(beats) == 3 and kv and notes and answers,
                "every message of the pipeline")  # fmt: skip

    # two gateways claim a new prefix: the first claim holds for both (Router.agree)
    other_gateway = await bus(GATEWAY)
    assert await gateway.claim(S.claims, "00ab", "1") == "1"
    assert await other_gateway.claim(S.claims, "00ab", "2") == "1"
    assert await other_gateway.claim(S.claims, "00cd", "2") == "2"

    # the bus API: a gateway answers, a client reads the reply and a stream on its inbox
    async def generate(m: Message) -> None:
        for chunk in (b"chunk-1", b"chunk-2", b"[DONE]"):
            await gateway.publish(m.reply, chunk)

    await gateway.subscribe(S.api_generate, generate, queue="gateways")
    assert (await client.nc.request(S.api_generate, b"{}", timeout=5)).data == b"chunk-1"
    sub = await client.nc.subscribe(client.nc.new_inbox())
    await client.nc.publish(S.api_generate, b"{}", reply=sub.subject)
    got = [(await sub.next_msg(timeout=5)).data for _ in range(3)]
    assert got == [b"chunk-1", b"chunk-2", b"[DONE]"]
    assert violations(server)[before:] == [] and client.errors == []


async def test_the_bus_api_user_cannot_read_prompts_or_outputs(bus, client: Client) -> None:
    gateway = await bus(GATEWAY)
    for subject in (f"{S.req}.>", S.req, "_SGLBUS_WORK.>", S.out("*"), S.detok("*"), S.ctl(">"), ">"):
        seen = await client.nc.subscribe(subject)
        assert await client.refused("subscription", subject), (subject, client.errors)
        await gateway.publish_work(S.req, b"a secret prompt")
        await gateway.publish(S.out("gw1"), b"someone's answer")
        with pytest.raises(nats.errors.TimeoutError):
            await seen.next_msg(timeout=QUIET_S)


async def test_the_bus_api_user_cannot_forge_heartbeats_requests_or_aborts(bus, client: Client) -> None:
    gateway, scheduler = await bus(GATEWAY), await bus(SCHEDULER)
    beats, work, aborts = [], [], []
    await gateway.subscribe(S.ctl("heartbeat"), collect(beats))
    await scheduler.subscribe_work(S.req, "schedulers", collect(work), ack_wait=30)
    await scheduler.subscribe(S.abort, collect(aborts))
    forged = {S.ctl("heartbeat"): b'{"service": "scheduler", "worker": "0"}', S.req: b"forged",
              S.abort: b'{"rids": ["someone-else"]}', S.detok("0"): b"tokens"}  # fmt: skip
    for subject, data in forged.items():
        await client.nc.publish(subject, data)
        assert await client.refused("publish", subject), (subject, client.errors)
    await asyncio.sleep(QUIET_S)
    # (the work queue still holds the earlier tests' prompts: only the forged one must not be there)
    assert beats == [] and aborts == [] and b"forged" not in [m.data for m in work]


async def test_the_bus_api_user_cannot_purge_or_delete_the_work_queue(bus, client: Client) -> None:
    gateway, scheduler = await bus(GATEWAY), await bus(SCHEDULER)
    await gateway.publish_work(S.req, b"kept", key="7")  # a lane nobody takes yet: the message waits
    js = client.nc.jetstream(timeout=1)
    attempts = {f"$JS.API.STREAM.PURGE.{STREAM}": js.purge_stream(STREAM),
                f"$JS.API.STREAM.DELETE.{STREAM}": js.delete_stream(STREAM),
                f"$JS.API.STREAM.MSG.DELETE.{STREAM}": js.delete_msg(STREAM, 1),
                "$JS.API.INFO": js.account_info()}  # fmt: skip
    for subject, attempt in attempts.items():
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await attempt
        assert await client.refused("publish", subject), (subject, client.errors)
    work: list[Message] = []
    await scheduler.subscribe_work(S.req, "schedulers", collect(work), ack_wait=30, key="7")
    await until(lambda: [m.data for m in work] == [b"kept"], "the stored message, still there")


@pytest.fixture
def compose_nats(tmp_path) -> Iterator[tuple[str, dict[str, str]]]:
    """nats-server on deploy/nats.conf, as compose runs it, its passwords in its environment."""
    passwords = {role: f"pw-{role}-{os.getpid()}" for role in ROLES}
    env = {**os.environ, **{password_env(role): pw for role, pw in passwords.items()}}
    port = free_port()
    cmd = [nats_server_binary(), "-c", os.path.join(ROOT, "deploy", "nats.conf"), "-a", "127.0.0.1", "-p",
           str(port), "-js", "-sd", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port("127.0.0.1", port, 15), "nats-server on deploy/nats.conf did not start"
        yield f"nats://127.0.0.1:{port}", passwords
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_compose_config_admits_each_role_to_its_subjects_only(compose_nats) -> None:
    url, passwords = compose_nats
    for role in (GATEWAY, SCHEDULER, DETOKENIZER):
        t = await NatsTransport.connect(url, role, 10, BusAuth(user=role, password=passwords[role]))
        await t.check_jetstream(url, patience=10)  # what every service does at start
        await t.close()
    with pytest.raises(PermissionError):  # another role's password
        await NatsTransport.connect(url, "x", 10, BusAuth(user=GATEWAY, password=passwords[BUS_API]))
    client = Client()
    client.nc = await nats.connect(url, user=BUS_API, password=passwords[BUS_API], error_cb=client.on_error)
    await client.nc.subscribe("sglbus.req.>")  # deploy/compose-smoke.sh checks the same
    assert await client.refused("subscription", "sglbus.req.>")
    await client.nc.close()
