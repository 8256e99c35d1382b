"""The gateway's request manager against a bus that records what it is told: output of a request
nobody here waits for any more (its client went away, or the gateway failed it while its worker was
down) gets its new attempt aborted, once, and is settled by its final output, so the work queue does
not run it again; output of a request still waited for is never aborted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import services.gateway.request_manager as request_manager
from services.gateway.generate_input import parse_generate_input
from services.gateway.request_manager import RequestManager
from services.gateway.request_state import RequestState
from shared.finish import Abort, Length
from shared.messages import AbortReq, BatchTextOut, Decoder, TextOut, encode
from shared.transport import ACK, InProcessTransport, Message

VOCAB = 1000


class RecordingBus(InProcessTransport):
    """Records aborts published and work deliveries settled."""

    def __init__(self) -> None:
        super().__init__()
        self.aborts: list[AbortReq] = []
        self.settled: list[tuple[str, str]] = []
        self._abort_dec = Decoder(AbortReq)

    async def publish(self, subject: str, data: bytes, reply: str | None = None) -> None:
        if subject.endswith(".abort"):
            self.aborts.append(self._abort_dec(data))
        await super().publish(subject, data, reply)

    async def settle_work(self, token: str, verdict: str) -> None:
        self.settled.append((token, verdict))

    def aborted(self, rid: str) -> int:
        """How many aborts named `rid`."""
        return sum(rid in a.rids for a in self.aborts)


@pytest.fixture
def bus() -> RecordingBus:
    return RecordingBus()


@pytest.fixture
def rm(bus: RecordingBus) -> Iterator[RequestManager]:
    requests = RequestManager(None, bus, "sglbus", VOCAB, gateway_id="gw")
    yield requests
    requests._pool.shutdown(wait=True)


def _out(rid: str, offset: int, attempt: int = 1, finish=None, token: str = "") -> TextOut:
    return TextOut(rid=rid, text="x", output_ids=[7], offset=offset, attempt=attempt, finish=finish,
                   work_token=token if finish is not None else "")  # fmt: skip


async def _deliver(rm: RequestManager, *outs: TextOut) -> None:
    """As the detokenizer sends them, on this gateway's own subject."""
    await rm._on_text(Message(rm.out_subject, encode(BatchTextOut(outs=list(outs), worker="w0"))))


async def _submit(rm: RequestManager, rid: str, n: int = 1, owner: str = "") -> list[RequestState]:
    req = parse_generate_input({"input_ids": [1, 2, 3], "rid": rid, "sampling_params": {"n": n}})
    return await rm.submit(req, owner)


def test_a_stream_failed_while_its_worker_was_down_has_its_new_attempt_aborted_once_then_settled(rm, bus):
    """The scheduler was stopped: the gateway failed the stream and sent an abort that died with it.
    The restarted scheduler runs the request again (attempt 2) for nobody: one abort stops it, and
    its final output acknowledges the work item, so it is not delivered a third time."""

    async def run():
        (st,) = await _submit(rm, "r1")
        r1 = st.rid  # the bus's id for it (the client's rid is its label)
        events = []

        async def client():
            async for event in rm.stream([st]):
                events.append(event)

        reader = asyncio.ensure_future(client())
        await _deliver(rm, _out(r1, 0))
        await asyncio.sleep(0)
        rm.fail("worker w0 is down", [r1])  # the gateway's liveness check (service.py)
        await rm.abort([r1])
        await reader
        assert events[-1].finish == Abort("worker w0 is down", 503) and rm.in_flight == 0
        assert bus.aborted(r1) == 1  # the liveness check's, lost with the stopped scheduler
        await _deliver(rm, _out(r1, 0, attempt=2))  # the restarted scheduler runs it again
        assert bus.aborted(r1) == 2
        await _deliver(rm, _out(r1, 1, attempt=2), _out(r1, 2, attempt=2))
        assert bus.aborted(r1) == 2  # once per attempt, not per output
        await _deliver(rm, _out(r1, 3, attempt=2, finish=Abort("aborted"), token="t2"))
        assert ("t2", ACK) in bus.settled

    asyncio.run(run())


def test_a_forgotten_request_is_aborted_again_only_by_a_later_attempt(rm, bus):
    """The client went away: the gateway aborted the request then; outputs already on their way need
    no abort of their own, but a new attempt (its scheduler died with the abort) does."""

    async def run():
        (st,) = await _submit(rm, "r2")
        r2 = st.rid
        await _deliver(rm, _out(r2, 0))
        stream = rm.stream([st])
        await anext(stream)
        await stream.aclose()  # the client went away
        assert bus.aborted(r2) == 1
        await _deliver(rm, _out(r2, 1), _out(r2, 2))
        assert bus.aborted(r2) == 1
        await _deliver(rm, _out(r2, 0, attempt=2))
        assert bus.aborted(r2) == 2
        assert not bus.settled  # nothing finished yet: no token to settle

    asyncio.run(run())


def test_an_unknown_rid_on_our_subject_is_aborted_once_and_settled_when_it_ends(rm, bus):
    """Our subject carries only our requests: an unknown rid is one this gateway forgot (a run of
    it before a restart with the same gateway_id, or one whose state is long gone)."""

    async def run():
        await _deliver(rm, _out("old", 0, attempt=3), _out("older", 4))
        await _deliver(rm, _out("old", 1, attempt=3))
        assert [a.rids for a in bus.aborts] == [["old", "older"]]  # one message for the batch
        await _deliver(rm, _out("old", 2, attempt=3, finish=Abort("aborted"), token="t3"))
        assert bus.settled == [("t3", ACK)] and bus.aborted("old") == 1

    asyncio.run(run())


def test_output_of_a_request_still_waited_for_is_never_aborted(rm, bus):
    async def run():
        (st,) = await _submit(rm, "r3")
        r3 = st.rid
        await _deliver(rm, _out(r3, 0), _out(r3, 1))
        await _deliver(rm, _out(r3, 0, attempt=2))  # a restart it can take: not streamed yet
        await _deliver(rm, _out(r3, 1, attempt=2, finish=Length(2), token="t"))
        (done,) = await rm.wait([st])
        return done

    done = asyncio.run(run())
    assert not bus.aborts and bus.settled == [("t", ACK)]
    assert done.finish == Length(2) and done.output_ids == [7, 7] and done.attempt == 2


def test_a_sample_that_finished_is_not_aborted_nor_settled_while_its_siblings_run(rm, bus):
    """n > 1 is one delivery: a sample that already finished runs again when the delivery does, and
    aborting it (or its shared prefill) would end its siblings too; the last sibling's final output
    settles the delivery."""

    async def run():
        samples = await _submit(rm, "g", n=2)
        group = samples[0].group
        assert group is not None
        prefill, a, b = (m.rid for m in group)
        await _deliver(rm, _out(prefill, 0, finish=Length(0), token="t1"))
        await _deliver(rm, _out(a, 0, finish=Length(1), token="t1"))
        assert not bus.settled  # b still runs
        # the worker died; the delivery runs again: the finished prefill and sample a come back too
        await _deliver(rm, _out(a, 0, attempt=2), _out(prefill, 0, attempt=2, finish=Length(0), token="t2"))
        assert not bus.aborts and not bus.settled
        await _deliver(rm, _out(b, 0, attempt=2, finish=Length(1), token="t2"))
        assert bus.settled == [("t2", ACK)]
        await rm.wait(samples)
        assert not bus.aborts

    asyncio.run(run())


def test_the_aborted_rids_kept_are_bounded(rm, bus, monkeypatch):
    monkeypatch.setattr(request_manager, "_ABORTED_KEPT", 8)

    async def run():
        for i in range(20):
            await _deliver(rm, _out(f"stray{i}", 0))
        await _deliver(rm, _out("stray19", 1))  # still remembered
        await _deliver(rm, _out("stray0", 1))  # forgotten long ago: aborted again

    asyncio.run(run())
    assert len(rm._aborted) == 8
    assert bus.aborted("stray19") == 1 and bus.aborted("stray0") == 2


def test_one_request_cannot_ask_for_millions_of_states_and_a_full_gateway_sheds_load(bus):
    """prompts x n past max_request_states is a 400 before anything is tokenized or published; past
    max_inflight new requests are refused (503) while those in flight go on, and room comes back as
    they end."""
    rm = RequestManager(None, bus, "sglbus", VOCAB, gateway_id="gw", max_request_states=64, max_inflight=12)

    async def run():
        huge = parse_generate_input({"input_ids": [[1, 2]] * 1000, "sampling_params": {"n": 128}})
        with pytest.raises(ValueError, match=r"at most 64 prompts x n .* 1000 x 128 = 128000"):
            await rm.submit(huge)
        assert rm.in_flight == 0
        held = [await _submit(rm, f"h{i}", n=2) for i in range(4)]  # 12 in flight: 2 samples + a prefill each
        with pytest.raises(request_manager.NotAccepting, match="12 requests in flight"):
            await _submit(rm, "late")
        first = held[0]
        for st in first:
            await _deliver(rm, _out(st.rid, 0, finish=Length(1), token="t"))
        await rm.wait(first)
        assert len(await _submit(rm, "later")) == 1  # room again

    try:
        asyncio.run(run())
    finally:
        rm._pool.shutdown(wait=True)


def test_the_bus_id_is_the_gateways_own_and_the_clients_rid_a_label(rm, bus):
    """Two clients may use the same rid, and a rid used again once its request ended is a new
    request with a new bus id (never one an old abort or a stray output still names); one client
    cannot run two requests with the same rid at once."""

    async def run():
        (a,) = await _submit(rm, "same", owner="10.0.0.1/-")
        (b,) = await _submit(rm, "same", owner="10.0.0.2/-")
        assert a.label == b.label == "same" and a.rid != b.rid
        assert a.rid.startswith("gw-") and b.rid.rsplit("-", 1)[0] == a.rid.rsplit("-", 1)[0]  # one boot
        with pytest.raises(ValueError, match="rid 'same' is already in use"):
            await _submit(rm, "same", owner="10.0.0.1/-")
        await _deliver(rm, _out(a.rid, 0, finish=Length(1), token="t"))
        await rm.wait([a])
        (again,) = await _submit(rm, "same", owner="10.0.0.1/-")  # ended: the rid is free again
        assert again.rid not in (a.rid, b.rid)
        return a, b

    a, b = asyncio.run(run())
    assert {r for m in bus.aborts for r in m.rids} == set()


def test_aborts_reach_only_the_callers_own_requests(rm, bus):
    """By rid or `abort_all`, a caller ends its own requests; another client's with the same rid, or
    any other, run on; the admin (owner None) reaches everyone's. A batch's or n > 1's rid ends its
    members (`rid_<i>`)."""
    me, other = "10.0.0.1/abc", "10.0.0.2/-"

    async def run():
        (mine,) = await _submit(rm, "x", owner=me)
        (theirs,) = await _submit(rm, "x", owner=other)
        (theirs2,) = await _submit(rm, "y", owner=other)
        samples = await _submit(rm, "g", n=2, owner=me)
        assert await rm.abort_owned(me, "nope") == 0 and not bus.aborts
        assert await rm.abort_owned(me, "y") == 0  # another client's rid: not found for me
        assert await rm.abort_owned(me, "x") == 1
        assert bus.aborts[-1].rids == [mine.rid]
        assert await rm.abort_owned(me, "g") == 3  # its two samples and their shared prefill
        assert set(bus.aborts[-1].rids) == {m.rid for m in samples[0].group}
        assert await rm.abort_owned(me, None) >= 1  # abort_all: mine only
        assert not {theirs.rid, theirs2.rid} & {r for m in bus.aborts for r in m.rids}
        assert await rm.abort_owned(None, "x") == 2  # the admin: both clients' "x"
        assert theirs.rid in bus.aborts[-1].rids
        assert await rm.abort_owned(None, None) == len(rm.active_rids())

    asyncio.run(run())


def test_a_client_past_its_own_bound_gets_a_429_while_others_are_served(bus):
    rm = RequestManager(
        None, bus, "sglbus", VOCAB, gateway_id="gw", max_inflight=100, max_inflight_per_client=4
    )

    async def run():
        mine = [await _submit(rm, f"m{i}", owner="10.0.0.1/-") for i in range(4)]
        with pytest.raises(request_manager.OverClientLimit, match="max_inflight_per_client 4") as e:
            await _submit(rm, "m4", owner="10.0.0.1/-")
        assert e.value.status == 429
        assert len(await _submit(rm, "other", owner="10.0.0.2/-")) == 1  # another client is served
        (st,) = mine[0]
        await _deliver(rm, _out(st.rid, 0, finish=Length(1), token="t"))
        await rm.wait([st])
        assert len(await _submit(rm, "m4", owner="10.0.0.1/-")) == 1  # room again

    try:
        asyncio.run(run())
    finally:
        rm._pool.shutdown(wait=True)
