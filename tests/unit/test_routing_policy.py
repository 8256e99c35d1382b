"""The gateway's router on a simulated deployment: workers that report their cache's blocks and their
load (KvEvents, as schedulers send them), requests of a multi-tenant shared-prefix workload."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from services.gateway.router.router import Router
from shared.kv_blocks import block_hashes
from shared.messages import KvEvents, WorkerLoad, encode
from shared.transport import InProcessTransport, Message, Subjects

pytestmark = pytest.mark.asyncio


class Fleet:
    """Workers as the router sees them: each "computes" a routed prompt by reporting its blocks."""

    def __init__(self, router: Router, workers: list[str]) -> None:
        self.router, self.workers = router, workers
        self.seq = dict.fromkeys(workers, 0)
        self.blocks: dict[str, set[int]] = {w: set() for w in workers}

    async def report(self, worker: str, stored=(), load: WorkerLoad | None = None) -> None:
        self.seq[worker] += 1  # each Fleet is one run of its workers
        self.blocks[worker] |= set(stored)
        ev = KvEvents(worker=worker, instance="i", seq=self.seq[worker], stored=list(stored),
                      load=load or WorkerLoad())  # fmt: skip
        await self.router._on_events(Message(f"sglbus.kv.{worker}", encode(ev)))


def make_router(workers: list[str], policy: str = "cache_aware") -> Router:
    return Router(policy, InProcessTransport(), Subjects(), lambda: list(workers))


def workload(
    groups: int, per_group: int, system_len: int = 256, seed: int = 0
) -> list[tuple[int, list[int]]]:
    """(group, prompt) interleaved across groups: each group's prompts share a system prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(49152) for _ in range(system_len)] for _ in range(groups)]
    return [(g, systems[g] + [rng.randrange(49152) for _ in range(20)])
            for _ in range(per_group) for g in range(groups)]  # fmt: skip


async def test_cache_aware_keeps_each_group_on_one_worker_and_spreads_groups() -> None:
    workers = ["0", "1", "2", "3"]
    router = make_router(workers)
    fleet = Fleet(router, workers)
    where: dict[int, set[str]] = {}
    for g, prompt in workload(8, 6):
        route = router.route(prompt)
        where.setdefault(g, set()).add(route.worker)
        await fleet.report(route.worker, block_hashes(prompt))  # its prefill ran: the blocks are cached
        router.release(route, grace=0)
    assert all(len(w) == 1 for w in where.values()), where
    per_worker = [sum(1 for w in where.values() if w == {x}) for x in workers]
    assert sum(per_worker) == 8 and max(per_worker) <= 3, per_worker  # no worker takes the lion's share
    assert router.decisions["miss"] == 8 and router.decisions["hit"] == 40


async def test_a_burst_follows_the_first_request_of_its_group_before_any_event() -> None:
    workers = ["0", "1", "2"]
    router = make_router(workers)
    where: dict[int, set[str]] = {}
    for g, prompt in workload(6, 4):  # nothing reported: the overlay of routed prompts decides
        where.setdefault(g, set()).add(router.route(prompt).worker)
    assert all(len(w) == 1 for w in where.values()), where
    assert sorted(len([g for g, w in where.items() if w == {x}]) for x in workers) == [2, 2, 2]


async def test_load_can_outweigh_affinity_and_a_full_worker_gets_nothing() -> None:
    workers = ["0", "1"]
    router = make_router(workers)
    fleet = Fleet(router, workers)
    (_, prompt), (_, other) = workload(1, 2)
    await fleet.report("0", block_hashes(prompt))
    assert router.route(prompt).worker == "0"  # a hit
    # worker 0's queue holds far more prefill than recomputing the prefix elsewhere costs
    await fleet.report("0", load=WorkerLoad(waiting=40, waiting_tokens=20_000))
    route = router.route(other)
    assert (route.worker, route.outcome) == ("1", "imbalance")
    # a worker at its admission bound gets nothing while another is below its own
    await fleet.report("0", load=WorkerLoad(waiting=4, max_queued=4))
    await fleet.report("1", load=WorkerLoad(waiting=100, waiting_tokens=10**6))
    assert router.route(prompt).worker == "1"


async def test_two_gateways_fed_the_same_events_decide_alike() -> None:
    workers = ["0", "1", "2", "3"]
    a, b = make_router(workers), make_router(workers)
    fa, fb = Fleet(a, workers), Fleet(b, workers)
    prompts = [p for _, p in workload(12, 1, seed=3)]
    for i, p in enumerate(prompts[:6]):  # some prefixes cached on some workers
        for fleet in (fa, fb):
            await fleet.report(workers[i % 4], block_hashes(p))
    for p in prompts:  # hits and misses alike
        ra, rb = a.route(p), b.route(p)
        assert ra.worker == rb.worker
        a.release(ra, grace=0)
        b.release(rb, grace=0)


async def test_round_robin_and_shared() -> None:
    rr = make_router(["0", "1", "2"], "round_robin")
    prompt = workload(1, 1)[0][1]
    assert [rr.route(prompt).worker for _ in range(6)] == ["0", "1", "2", "0", "1", "2"]
    shared = make_router(["0", "1"], "shared")
    route = shared.route(prompt)
    assert route.worker is None and route.outcome == "shared"
    assert make_router([]).route(prompt).worker is None  # no live worker yet: the shared lane


async def test_info_reports_decisions_and_workers() -> None:
    router = make_router(["0"])
    fleet = Fleet(router, ["0"])
    prompt = workload(1, 1)[0][1]
    await fleet.report("0", block_hashes(prompt), WorkerLoad(running=3, kv_total=100))
    router.route(prompt)
    info = router.info()
    assert info["decisions"]["hit"] == 1 and info["workers"]["0"]["cached_blocks"] == len(
        block_hashes(prompt)
    )
    assert msgspec.convert(info["workers"]["0"]["load"], WorkerLoad).running == 3


async def test_a_pinned_request_goes_to_its_worker_when_it_is_live() -> None:
    router = make_router(["0", "1"])
    prompt = workload(1, 1)[0][1]
    await Fleet(router, ["0", "1"]).report("0", block_hashes(prompt))
    assert router.route(prompt, pin="1").worker == "1"
    assert router.route(prompt, pin="7").worker == "0"  # not live: the policy decides
    assert make_router(["0", "1"], "shared").route(prompt, pin="1").worker == "1"


async def test_gateways_share_what_they_routed_so_a_burst_through_both_keeps_groups_whole() -> None:
    workers = ["0", "1", "2", "3"]
    bus = InProcessTransport()
    a = Router("cache_aware", bus, Subjects(), lambda: workers, name="a")
    b = Router("cache_aware", bus, Subjects(), lambda: workers, name="b")
    await a.start()
    await b.start()
    where: dict[int, set[str]] = {}
    routes = []
    for i, (g, prompt) in enumerate(workload(8, 6)):  # nothing computed yet: a burst
        router = a if i % 2 else b
        route = router.route(prompt)
        await router.announce(route)
        routes.append((i % 2, route))
        where.setdefault(g, set()).add(route.worker)
        await asyncio.sleep(0.001)  # the note reaches the other gateway
    assert all(len(w) == 1 for w in where.values()), where
    assert sorted(len([g for g, w in where.items() if w == {x}]) for x in workers) == [2, 2, 2, 2]
    # both count every routed request in the workers' load, until the worker says it took them
    assert a._load("0").requests == b._load("0").requests == 12
    for router in (a, b):
        await Fleet(router, workers).report("0", load=WorkerLoad(waiting=12, received=12))
        assert router._load("0").requests == 12 and not router._load("0").transit


async def test_a_report_sent_mid_burst_keeps_what_is_still_on_its_way() -> None:
    router = make_router(["0", "1"], "least_load")
    prompts = [p for _, p in workload(14, 1)]
    assert sorted(router.route(p).worker for p in prompts[:8]) == ["0"] * 4 + ["1"] * 4
    # worker 0 took one of its four off its lane and runs it: three are still on their way
    await Fleet(router, ["0", "1"]).report("0", load=WorkerLoad(running=1, received=1))
    assert router._load("0").requests == 4
    assert sorted(router.route(p).worker for p in prompts[8:]) == ["0"] * 3 + ["1"] * 3


async def test_gateways_that_hear_no_note_during_a_burst_agree_through_claims() -> None:
    """As measured with two gateways on one machine: each routes its whole share of a burst before it
    handles a RouteNote of the other. Different load pictures (here: each one's own routed requests)
    then put a group's first requests on one worker per gateway; a claim on the bus (the first
    gateway's choice for a new prefix holds) keeps every group on one worker. Requests routed on a
    proposal that lost the claim follow it, and the loads count them where they went."""
    workers = ["0", "1", "2", "3"]

    async def burst(peers: int) -> tuple[dict[int, set[str]], list[Router]]:
        bus = InProcessTransport()  # no start(): the notes never arrive
        routers = [Router("cache_aware", bus, Subjects(), lambda: workers, name=n, peers=lambda: peers)
                   for n in ("a", "b")]  # fmt: skip
        where: dict[int, set[str]] = {}
        for i, (g, prompt) in enumerate(workload(16, 8, system_len=1024, seed=3)):
            router = routers[(i // 3) % 2]  # uneven shares: their pictures differ
            route = router.route(prompt)
            await router.agree(route)
            where.setdefault(g, set()).add(route.worker)
        return where, routers

    split, _ = await burst(peers=0)  # no other gateway known: no claims, each decides alone
    assert sum(len(w) > 1 for w in split.values()) > 0
    whole, routers = await burst(peers=1)
    assert all(len(w) == 1 for w in whole.values()), whole
    for r in routers:  # each request counted once, on the worker it went to
        assert sum(r.per_worker.values()) == sum(len(ld.transit) for ld in r._loads.values())
        assert sum(r._load(w).transit_tokens for w in workers) == sum(t for ld in r._loads.values()
                                                                     for _, t in ld.transit)  # fmt: skip


async def test_a_bus_that_keeps_no_claims_costs_one_failed_claim_not_one_per_prefix() -> None:
    asked = []

    class NoClaims(InProcessTransport):
        async def claim(self, bucket: str, key: str, value: str) -> str:
            asked.append(key)
            raise PermissionError("no permission for the claims' bucket")

    workers = ["0", "1"]
    router = Router("cache_aware", NoClaims(), Subjects(), lambda: workers, name="a", peers=lambda: 1)
    for _, prompt in workload(4, 1, system_len=1024):  # four new prefixes
        route = router.route(prompt)
        await router.agree(route)
        assert route.worker in workers  # its own choice
    assert len(asked) == 1
