"""Which worker runs a request: the gateway's router.

Each request goes to one live worker's own lane of the work queue (`Transport.publish_work(key=...)`),
chosen by the policy (`policies.py`) from, per worker:
- how much of the prompt it holds: the leading blocks of the prompt (shared/kv_blocks.py) in the
  index built from the workers' KvEvents (`kv_index.py`: the same in every gateway), or in this
  gateway's overlay of prompts it routed there that have not produced output yet (their blocks are
  being computed: without it, the second request of a new prefix, sent before the first one's
  prefill ended, would look like a miss everywhere);
- its load: the last `WorkerLoad` it reported (with every KvEvents message: after each step that
  changed it, at least once a second), plus the requests routed to it that it had not taken off its
  lane yet by that report (`WorkerLoad.received`), so a burst counts at once and a report sent
  mid-burst does not make a busy worker look idle.
Every gateway tells the others what it routed (`RouteNote` on `<prefix>.route`: the worker, the
prompt's blocks, and later that its output came): the overlay and the routed-since counts are then
the same in every gateway, not each gateway's own share (a note of a gateway that died expires after
FOREIGN_TTL_S).
A worker past its admission bound (`max_queued`) gets nothing while another one is below its own.
With policy `shared`, or before any worker is known, the request goes to the shared lane, where any
scheduler takes it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.router.kv_index import KvIndex
from services.gateway.router.policies import Candidate, make_policy
from shared.kv_blocks import BLOCK_TOKENS, block_hashes
from shared.messages import Decoder, KvEvents, KvSnapshot, RouteNote, WorkerLoad, encode
from shared.transport import Message, Subjects, Subscription, Transport

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
# a routed prompt's blocks stay in the overlay this long after its first output (by then the
# worker's KvEvents with those blocks have arrived: they leave the scheduler before its output does)
RELEASE_GRACE_S = 1.0
# another gateway's routed prompt counts this long at most (that gateway may have died before its release)
FOREIGN_TTL_S = 60.0
# a routed request no report has counted as arrived after this long no longer counts as on its way
TRANSIT_TTL_S = 10.0
# a claim on a new prefix (`Router.agree`) that the bus does not answer in this long: our own choice,
# and no claims for CLAIMS_OFF_S (a NATS whose permissions lack the claims' bucket would otherwise cost
# every new prefix the whole timeout)
CLAIM_TIMEOUT_S = 1.0
CLAIMS_OFF_S = 60.0
OUTCOMES = ("hit", "miss", "imbalance", "shared")


@dataclass
class Route:
    """One routing decision. `outcome`: `hit` (the worker holding most of the prompt), `miss` (no
    worker holds any of it), `imbalance` (one holds more, but load sent it elsewhere), `shared` (no
    worker chosen: the shared lane)."""

    worker: str | None
    outcome: str
    overlap: int = 0  # prompt tokens the chosen worker holds
    new_tokens: int = 0  # prompt tokens it computes
    blocks: list[int] = field(default_factory=list)  # in the overlay until released
    released: bool = False
    id: int = 0  # this gateway's number for it, in its RouteNotes
    noted: float = 0.0  # when another gateway's note brought it
    transit: tuple[float, int] | None = None  # its entry in its worker's load (`_Load.transit`)


@dataclass
class Dispatch:
    """One work-queue message as published (a request, or an n > 1 group): where it went, and its
    receipt, to take it back and send it elsewhere when its worker dies (`RequestManager.reroute`)."""

    msg: Any  # the GenerateReq
    route: Route
    receipt: int = 0
    reroutes: int = 0


@dataclass
class _Load:
    """A worker's load as the router weighs it: its last report, plus the requests routed to it (by
    any gateway: RouteNotes) that it had not taken off its lane yet (`WorkerLoad.received`)."""

    report: WorkerLoad
    instance: str = ""  # the worker's run the report came from
    transit: deque[tuple[float, int]] = field(default_factory=deque)  # (when routed, prefill tokens)
    transit_tokens: int = 0

    @property
    def requests(self) -> int:
        return self.report.running + self.report.waiting + len(self.transit)

    @property
    def full(self) -> bool:
        return 0 < self.report.max_queued <= self.report.waiting + len(self.transit)

    def add(self, tokens: int) -> tuple[float, int]:
        entry = (time.monotonic(), tokens)
        self.transit.append(entry)
        self.transit_tokens += tokens
        return entry

    def drop(self, entry: tuple[float, int]) -> None:
        """A routed request that went elsewhere after all (unless a report counted it already)."""
        try:
            self.transit.remove(entry)
            self.transit_tokens -= entry[1]
        except ValueError:
            pass

    def update(self, instance: str, report: WorkerLoad) -> None:
        """A new report: the requests it says arrived since the last one are no longer on their way
        (a run first seen counts from 0; a new run of a worker seen before drops what went to the one
        before: the work queue delivers that again)."""
        arrived = report.received - (self.report.received if instance == self.instance else 0)
        if self.instance and instance != self.instance:
            self.transit.clear()
            self.transit_tokens = 0
        self.instance, self.report = instance, report
        stale = time.monotonic() - TRANSIT_TTL_S
        while self.transit and (arrived > 0 or self.transit[0][0] < stale):
            self.transit_tokens -= self.transit.popleft()[1]
            arrived -= 1


class Router:
    def __init__(self, policy: str, transport: Transport, subjects: Subjects, live: Callable[[], list[str]],
                 balance_weight: float = 32.0, name: str = "",
                 peers: Callable[[], int] = lambda: 0) -> None:  # fmt: skip
        """`live`: the workers that can serve now (live scheduler and detokenizer); `name`: this
        gateway's, in its RouteNotes; `peers`: how many other gateways are alive (`agree`)."""
        self.policy_name = policy
        self.policy = None if policy == "shared" else make_policy(policy, balance_weight)
        self.transport, self.subjects, self.live, self.name = transport, subjects, live, name
        self.peers = peers
        # a new prefix's first block -> (the claim on the bus, the worker this gateway proposed)
        self._claiming: dict[str, tuple[asyncio.Future[str], str]] = {}
        self._claims_off_until = 0.0
        self.index = KvIndex()
        self._loads: dict[str, _Load] = {}
        self._pending: dict[int, dict[str, int]] = {}  # overlay: block -> {worker: routed prompts}
        self._ids = itertools.count(1)
        self._foreign: dict[tuple[str, int], Route] = {}  # other gateways' routes not released yet
        self._purged = time.monotonic()
        self._note_dec = Decoder(RouteNote)
        self._note_sub: Subscription | None = None
        self.decisions: Counter[str] = Counter()
        self.per_worker: Counter[str] = Counter()
        self._events_dec, self._snap_dec = Decoder(KvEvents), Decoder(KvSnapshot)
        self._syncing: dict[str, asyncio.Task] = {}
        self._sub: Subscription | None = None
        self.on_route: Callable[[Route], None] | None = None  # the gateway's metrics

    async def start(self) -> None:
        self._sub = await self.transport.subscribe(self.subjects.kv_events("*"), self._on_events)
        self._note_sub = await self.transport.subscribe(self.subjects.route_notes, self._on_note)

    async def stop(self) -> None:
        for sub in (self._sub, self._note_sub):
            if sub is not None:
                await sub.unsubscribe()
        for task in self._syncing.values():
            task.cancel()

    # -- decisions --------------------------------------------------------------------------------
    def route(self, prompt: list[int], exclude: Collection[str] = (), pin: str | None = None) -> Route:
        """`pin`: the worker the request asked for (data_parallel_rank), if it is live."""
        live = [w for w in self.live() if w not in exclude]
        if pin is not None and pin in live:
            live = [pin]
        elif self.policy is None or not live:
            return self._decided(Route(None, "shared", new_tokens=len(prompt)))
        blocks = block_hashes(prompt)
        held = self.index.overlaps(blocks, live, self._pending)
        cands = []
        for w in live:
            load = self._load(w)
            overlap = min(held[w] * BLOCK_TOKENS, len(prompt) - 1)  # the last token is always computed
            queued = load.report.waiting_tokens + load.transit_tokens
            cands.append(
                Candidate(w, overlap, len(prompt) - overlap, queued, load.requests, self.index.size(w))
            )
        open_ = [c for c in cands if not self._load(c.worker).full] or cands
        key = blocks[0] if blocks else hash(tuple(prompt))
        best = open_[0] if len(open_) == 1 or self.policy is None else self.policy(open_, key)
        most = max(c.overlap for c in cands)
        outcome = "miss" if most == 0 else "hit" if best.overlap == most else "imbalance"
        route = Route(best.worker, outcome, best.overlap, best.new_tokens, blocks, id=next(self._ids))
        self._hold(route)
        return self._decided(route)

    async def agree(self, route: Route) -> None:
        """Awaited after `route` when other gateways route too: a new prefix (no worker holds any of
        it, nor was it routed anywhere lately, as this gateway knows) goes where the first gateway
        to claim it on the bus sent it (`Transport.claim`, keyed by its first block). In a burst
        through several gateways each one decides before it hears the others' RouteNotes (its
        event loop has its whole share of the burst ready at once: measured on cpu2, every gateway
        routed its ~500 requests before it handled the first note of the other), so without the
        claim the first requests of a group went to one worker per gateway. Requests of the same
        prefix this gateway routed meanwhile (on its own proposal) follow the claim too."""
        if not route.blocks or route.worker is None:
            return
        key = f"{route.blocks[0] & 0xFFFFFFFFFFFFFFFF:016x}"
        claiming = self._claiming.get(key)
        if claiming is None:
            if route.outcome != "miss" or not self.peers() or time.monotonic() < self._claims_off_until:
                return
            future = asyncio.ensure_future(self._claim(key, route.worker))
            claiming = self._claiming[key] = (future, route.worker)
            # kept a moment after it is answered: requests decided on our proposal meanwhile follow it
            loop = asyncio.get_running_loop()
            future.add_done_callback(lambda _: loop.call_later(RELEASE_GRACE_S, self._forget_claim, key))
        future, proposed = claiming
        if route.worker != proposed:
            return  # sent elsewhere by the policy (load), not by our proposal
        winner = await asyncio.shield(future)
        if winner != route.worker and winner in self.live() and not self._load(winner).full:
            self._move(route, winner)

    def _forget_claim(self, key: str) -> None:
        self._claiming.pop(key, None)

    async def _claim(self, key: str, worker: str) -> str:
        try:
            claim = self.transport.claim(self.subjects.claims, key, worker)
            return await asyncio.wait_for(claim, CLAIM_TIMEOUT_S)
        except Exception as e:  # no answer from the bus: our own choice, and none asked for a while
            if time.monotonic() >= self._claims_off_until:
                log.warning("claiming a new prefix on the bus failed (%s: %s); routing without claims for "
                            "%.0f s", type(e).__name__, e, CLAIMS_OFF_S)  # fmt: skip
            self._claims_off_until = time.monotonic() + CLAIMS_OFF_S
            return worker

    def _move(self, route: Route, worker: str) -> None:
        assert route.worker is not None
        self._unpend(route)
        if route.transit is not None:
            self._load(route.worker).drop(route.transit)
        self.per_worker[route.worker] -= 1
        route.worker = worker
        self.per_worker[worker] += 1
        self._hold(route)

    async def announce(self, route: Route) -> None:
        """Tell the other gateways where this prompt went (awaited right after `route`, before the
        request is published: in a burst, a note left to a task of its own went out late)."""
        if route.id and self.name:
            note = RouteNote(gateway=self.name, id=route.id, worker=route.worker or "", blocks=route.blocks,
                             new_tokens=route.new_tokens)  # fmt: skip
            await self._publish(note)

    def _hold(self, route: Route) -> None:
        """Count a routed prompt: in its worker's load until the worker's next report, its blocks in
        the overlay until released."""
        assert route.worker is not None
        route.transit = self._load(route.worker).add(route.new_tokens)
        for h in route.blocks:
            into = self._pending.setdefault(h, {})
            into[route.worker] = into.get(route.worker, 0) + 1

    def _tell(self, note: RouteNote) -> None:
        """Publish a note for the other gateways (in order: the tasks run as created)."""
        if self.name:
            asyncio.get_running_loop().create_task(self._publish(note))

    async def _publish(self, note: RouteNote) -> None:
        try:
            await self.transport.publish(self.subjects.route_notes, encode(note))
        except Exception as e:  # the bus is down: the others miss one note (their picture, not ours)
            log.debug("route note not sent: %s", e)

    def release(self, route: Route, grace: float = RELEASE_GRACE_S) -> None:
        """The routed prompt is computed (its first output came) or it ended: its blocks leave the
        overlay after `grace` seconds (the index has them by then, if its worker kept them)."""
        if route.released or route.worker is None:
            return
        self._let_go(route, grace)
        if route.id:
            self._tell(RouteNote(gateway=self.name, id=route.id, released=True))

    def _let_go(self, route: Route, grace: float) -> None:
        route.released = True
        if grace > 0:
            asyncio.get_running_loop().call_later(grace, self._unpend, route)
        else:
            self._unpend(route)

    def _unpend(self, route: Route) -> None:
        assert route.worker is not None
        for h in route.blocks:
            into = self._pending.get(h)
            if into is None or route.worker not in into:
                continue
            into[route.worker] -= 1
            if not into[route.worker]:
                del into[route.worker]
                if not into:
                    del self._pending[h]

    def _unpend_worker(self, worker: str) -> None:
        for h in [h for h, into in self._pending.items() if worker in into]:
            del self._pending[h][worker]
            if not self._pending[h]:
                del self._pending[h]

    async def _on_note(self, m: Message) -> None:
        """Another gateway's routing decision, or its release, counted as if it were ours."""
        try:
            note = self._note_dec(m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ignoring a message on %s that is not a RouteNote: %s", m.subject, e)
            return
        if note.gateway == self.name:
            return
        key, now = (note.gateway, note.id), time.monotonic()
        if note.released:
            route = self._foreign.pop(key, None)
            if route is not None:
                self._let_go(route, RELEASE_GRACE_S)
        elif note.worker and key not in self._foreign:
            route = Route(note.worker, "noted", 0, note.new_tokens, note.blocks, noted=now)
            self._foreign[key] = route
            self._hold(route)
        if now - self._purged > FOREIGN_TTL_S / 10:  # notes whose release never came
            self._purged = now
            for key in [k for k, r in self._foreign.items() if now - r.noted > FOREIGN_TTL_S]:
                self._let_go(self._foreign.pop(key), 0)

    def _decided(self, route: Route) -> Route:
        self.decisions[route.outcome] += 1
        self.per_worker[route.worker or ""] += 1
        if self.on_route is not None:
            self.on_route(route)
        return route

    def _load(self, worker: str) -> _Load:
        load = self._loads.get(worker)
        if load is None:
            load = self._loads[worker] = _Load(WorkerLoad())
        return load

    def forget(self, worker: str) -> None:
        """A worker that is gone: its blocks and load no longer count."""
        self.index.drop(worker)
        self._loads.pop(worker, None)

    # -- the workers' events -----------------------------------------------------------------------
    async def _on_events(self, m: Message) -> None:
        try:
            ev = self._events_dec(m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ignoring a message on %s that is not KvEvents: %s", m.subject, e)
            return
        self._load(ev.worker).update(ev.instance, ev.load)
        if ev.cleared:  # a flushed cache: nothing routed there before holds its blocks any more
            self._unpend_worker(ev.worker)
        if self.index.on_events(ev) and ev.worker not in self._syncing:
            task = asyncio.get_running_loop().create_task(self._sync(ev.worker))
            self._syncing[ev.worker] = task

    async def _sync(self, worker: str) -> None:
        """Ask the worker for its snapshot until the index has caught up with it."""
        try:
            for _ in range(5):
                try:
                    data = await self.transport.request(
                        self.subjects.ctl(f"kv_snapshot.{worker}"), b"", SNAPSHOT_TIMEOUT_S
                    )
                    if not self.index.on_snapshot(self._snap_dec(data)):
                        return
                except (TimeoutError, msgspec.DecodeError, msgspec.ValidationError) as e:
                    log.warning("no KV snapshot from worker %s yet: %s", worker, e)
                await asyncio.sleep(0.5)
        finally:
            self._syncing.pop(worker, None)

    # -- reports ---------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """For /get_server_info: the policy, its decisions, and each known worker's picture."""
        workers = {}
        for w in sorted(set(self._loads) | set(self.index.workers())):
            load = self._load(w)
            workers[w] = {
                "cached_blocks": self.index.size(w),
                "syncing": self.index.syncing(w),
                "routed": self.per_worker[w],
                "load": msgspec.to_builtins(load.report),
                "on_the_way": len(load.transit),
            }
        return {
            "policy": self.policy_name,
            "block_tokens": BLOCK_TOKENS,
            "decisions": {k: self.decisions[k] for k in OUTCOMES},
            "kv_snapshots": self.index.gaps,
            "workers": workers,
        }
