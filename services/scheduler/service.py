"""The scheduler behind the bus: requests and aborts arrive on asyncio handlers, the model steps in one
dedicated thread (a forward never blocks the event loop), each step's output goes back as one message.

Requests come from a work queue (JetStream on NATS): each delivery is kept alive (PROGRESS) while the
request waits or runs here, and the gateway acknowledges it once it has the final output. If this
process dies, what it held is delivered again to a live scheduler (a new attempt, from the start).
A step that fails as a whole stops the service: its process exits non-zero and its supervisor restarts
it, rather than limping on with unknown state; the running requests go back to the work queue, and run
alone when delivered again, so that a request that crashes schedulers is found out and ended
(quarantine.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from services.scheduler.crash_record import CrashRecord
from services.scheduler.kv_events import KvEventStream
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.model_runner import ModelRunner
from services.scheduler.scheduler import Scheduler
from shared.config import EngineConfig
from shared.heartbeat import INTERVAL_S, Heartbeat
from shared.messages import AbortReq, Decoder, GenerateReq, encode, encode_split
from shared.model_files import default_model_path, resolve_model_folder
from shared.transport import NAK, PROGRESS, TERM, Message, Subjects, Subscription, Transport, Work

log = logging.getLogger(__name__)

_WAITING_S = 0.005  # the pause of a loop whose requests all wait for work off the scheduler thread
_IDLE_CHECK_S = 1.0  # an idle scheduler checks KV integrity after this long without work
_ABORTED_KEPT = 10_000  # rids aborted lately: an abort can overtake its request on the bus


class SchedulerService:
    def __init__(self, config: EngineConfig, transport: Transport, runner: ModelRunner | None = None) -> None:
        self.cfg, self.transport = config, transport
        self.subjects = Subjects(config.subject_prefix)
        self._owns_runner = runner is None  # then stop() closes it (its tensor-parallel ranks)
        self.runner = runner or ModelRunner(
            config, resolve_model_folder(config.model_path, config.load_format != "dummy")
        )
        # who was running alone when this worker died before (in-process nothing dies on its own)
        record = None if transport.in_process else CrashRecord.for_worker(config, transport.where)
        self.scheduler = Scheduler(config, self.runner, record)
        self._give_back: list[str] = []  # work tokens of a failed step's requests, given back at the stop
        self._inbox: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subs: list[Subscription] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.integrity_error: str | None = None
        self._req_dec, self._abort_dec = Decoder(GenerateReq), Decoder(AbortReq)
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._failed: asyncio.Future[str] | None = None
        self._tasks: list[asyncio.Task] = []
        self._gateways: dict[str, float] = {}  # a gateway's output subject -> its last heartbeat
        self._last_beat = time.monotonic()  # the last heartbeat of anyone (our own included)
        self._detok: tuple[str, float] | None = None  # our detokenizer's instance and its last heartbeat
        self._started = time.monotonic()
        self._turned = time.monotonic()  # when the step thread last began a turn of its loop
        self.metrics = SchedulerMetrics()  # built on the scheduler thread, sent with each heartbeat
        # the routers' view of this worker (prefix-cache blocks and load); none in-process (one worker)
        self.kv_events = None if transport.in_process else KvEventStream(config.worker_id, self.scheduler)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()
        s = self.subjects
        ack_wait = self.cfg.request_ack_wait
        # the shared lane (any scheduler takes each request) and this worker's own (a router chose it)
        self._subs.append(await self.transport.subscribe_work(s.req, "schedulers", self._on_req, ack_wait))
        own = functools.partial(self._on_req, routed=True)
        self._subs.append(await self.transport.subscribe_work(s.req, "schedulers", own, ack_wait,
                                                              key=self.cfg.worker_id))  # fmt: skip
        self._subs.append(await self.transport.subscribe(s.abort, self._on_abort))
        self._subs.append(await self.transport.subscribe(s.ctl("heartbeat"), self._on_heartbeat))
        ctl = (("server_info", self._on_server_info), ("flush_cache", self._on_flush_cache),
               ("known_rids", self._on_known_rids))  # fmt: skip
        for what, handler in ctl:
            # any one scheduler answers on ctl.<what>; every scheduler on ctl.all.<what> (the gateway's
            # fan-out, which gathers the answers of all live workers)
            self._subs.append(await self.transport.subscribe(s.ctl(what), handler, queue="schedulers"))
            self._subs.append(await self.transport.subscribe(s.ctl_all(what), handler))
        if self.kv_events is not None:
            snapshot = s.ctl(f"kv_snapshot.{self.cfg.worker_id}")
            self._subs.append(await self.transport.subscribe(snapshot, self._on_kv_snapshot))
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()
        self._heartbeat = Heartbeat(self.transport, s.ctl("heartbeat"), "scheduler", self.cfg.worker_id,
                                    alive=self._thread.is_alive,
                                    report=lambda: {"metrics": self.metrics.latest})  # fmt: skip
        self._heartbeat.start()
        self._tasks += [self._loop.create_task(self._keep_deliveries_alive()),
                       self._loop.create_task(self._drop_orphans())]  # fmt: skip

    def stalled_for(self) -> float:
        """Seconds the step thread has been in its current turn (one step, or a wait of at most a
        second when idle): what `sglbus serve`'s watchdog judges besides the event loop's beat."""
        if self._thread is None or not self._thread.is_alive() or self._stop.is_set():
            return 0.0
        return time.monotonic() - self._turned

    async def wait_failed(self) -> str:
        """Returns (never raises) once the step thread died: why, for the log and the exit status."""
        assert self._failed is not None
        return await asyncio.shield(self._failed)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self._heartbeat.stop()
        for sub in self._subs:
            await sub.unsubscribe()
        self._stop.set()
        self._wake.set()
        if self._thread:
            await asyncio.to_thread(self._thread.join)
        self.scheduler.quarantine.stopping(self.scheduler)  # the thread is done: its state is ours
        for token in self._give_back:  # now that this process no longer takes them: to the next scheduler
            try:
                await self.transport.settle_work(token, NAK)
            except Exception:  # the bus is gone: the work queue delivers them again after ack_wait
                break
        if self._owns_runner:
            self.runner.close()

    def call(self, fn: Callable[[Scheduler], Any]) -> asyncio.Future:
        """Run fn(scheduler) on the scheduler thread between steps; await the result."""
        assert self._loop is not None
        fut: asyncio.Future = self._loop.create_future()

        def run() -> None:
            try:
                result = fn(self.scheduler)
            except Exception as e:  # handed to the awaiting caller
                self._loop.call_soon_threadsafe(_set, fut, None, e)
            else:
                self._loop.call_soon_threadsafe(_set, fut, result, None)

        self._put(run)
        return fut

    # -- bus handlers (event loop) ------------------------------------------------------------
    async def _on_req(self, m: Message, routed: bool = False) -> None:
        """`routed`: it came on this worker's own lane (a router chose this worker)."""
        work = m.work or Work("")
        if routed and work.deliveries == 1 and self.kv_events is not None:
            self.kv_events.received += 1  # the routers stop counting it as on its way
        try:
            msg = self._req_dec(m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:  # nobody to answer: drop it
            log.warning("dropping a request that does not decode: %s", e)
            await self.transport.settle_work(work.token, TERM)
            return
        if not _is_subject(msg.out_subject) or msg.rid in self._aborted or self._orphaned(msg.out_subject):
            # no valid place to answer, its client gave up before it arrived, or its gateway is gone
            await self.transport.settle_work(work.token, TERM)
            return
        new_tokens = None if self.kv_events is None else self.kv_events.new_tokens(msg.input_ids)
        self._put(lambda: self.scheduler.add_request(msg, work, new_tokens))

    async def _on_abort(self, m: Message) -> None:
        try:
            msg = self._abort_dec(m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ignoring an abort that does not decode: %s", e)
            return
        if msg.restart:
            self._put(lambda: self._restart(msg.rids))
            return
        if msg.finish is None:
            for rid in msg.rids:
                self._aborted[rid] = None
            while len(self._aborted) > _ABORTED_KEPT:
                self._aborted.popitem(last=False)
        self._put(lambda: self.scheduler.abort(msg.rids, msg.finish))

    def _restart(self, rids: list[str]) -> None:
        """(scheduler thread) Output of these requests was lost: drop them here and give their
        deliveries back, so the work queue runs them again from the start."""
        self.scheduler.quarantine.gave_back(self.scheduler.known_rids(rids))  # no fault of theirs
        for token in self.scheduler.drop(rids):
            self._publish_soon(self.transport.settle_work(token, NAK))

    async def _on_heartbeat(self, m: Message) -> None:
        self._last_beat = time.monotonic()
        try:
            beat = orjson.loads(m.data)
            if beat.get("service") == "gateway" and isinstance(beat.get("out_subject"), str):
                self._gateways[beat["out_subject"]] = time.monotonic()
            elif beat.get("service") == "detokenizer" and beat.get("worker") == self.cfg.worker_id:
                self._on_detokenizer_beat(beat)
        except (orjson.JSONDecodeError, AttributeError):
            pass

    def _on_detokenizer_beat(self, beat: dict) -> None:
        """A new run of our detokenizer (restarted, or the first one seen): the final outputs sent
        since the last sign of the one before (or since this scheduler started) may have gone to
        nobody, and their requests would wait for the work queue's redelivery (ack_wait). Give them
        back now: the gateway acknowledged those it got (a give-back then does nothing) and runs the
        others again."""
        if beat.get("leaving"):
            return
        now, instance = time.monotonic(), str(beat.get("instance"))
        if self._detok is None or self._detok[0] != instance:
            since = self._started if self._detok is None else self._detok[1] - INTERVAL_S
            self._tasks.append(asyncio.get_running_loop().create_task(self._give_back_finished(since)))
        self._detok = (instance, now)

    async def _give_back_finished(self, since: float) -> None:
        tokens = await self.call(lambda s: s.output.finished_since(since))
        if tokens:
            log.warning("a new detokenizer: %d requests that finished since it may have missed are "
                        "given back to the work queue", len(tokens))  # fmt: skip
        for token in tokens:
            await self.transport.settle_work(token, NAK)

    def _orphaned(self, out_subject: str) -> bool:
        """The gateway that waits for this output was seen, and has been silent for too long."""
        seen = self._gateways.get(out_subject)
        return seen is not None and time.monotonic() - seen > self.cfg.gateway_timeout

    async def _drop_orphans(self) -> None:
        """Requests whose gateway died (its clients are gone with it) stop here and leave the work
        queue, instead of running, and being delivered again, for nobody. A gateway is only judged
        while this process hears the bus: after a stall of its own (stopped, swapped out) or of the
        bus (no heartbeat from anyone), every gateway's clock starts again instead, since none of
        them could have been heard meanwhile."""
        last, timeout = time.monotonic(), self.cfg.gateway_timeout
        while True:
            await asyncio.sleep(timeout / 4)
            now = time.monotonic()
            stalled = now - last > timeout / 2 or now - self._last_beat > 3 * INTERVAL_S
            last = now
            if stalled:
                self._gateways = dict.fromkeys(self._gateways, now)
                continue
            gone = {subject for subject in self._gateways if self._orphaned(subject)}
            if gone:
                tokens = await self.call(functools.partial(_drop_for, gone))
                for token in tokens:
                    await self.transport.settle_work(token, TERM)
                if tokens:
                    log.warning("dropped %d requests of %d gateway(s) that stopped", len(tokens), len(gone))

    async def _keep_deliveries_alive(self) -> None:
        """Tell the work queue, well within ack_wait, that the requests here are still being worked
        on. When the step thread is dead this stops, and the deliveries go to another scheduler."""
        while True:
            await asyncio.sleep(self.cfg.request_ack_wait / 3)
            tokens = await self.call(lambda s: {r.work_token for r in (*s.waiting, *s.running)})
            for token in tokens:
                await self.transport.settle_work(token, PROGRESS)

    async def _on_server_info(self, m: Message) -> None:
        if m.reply:
            info = await self.call(self.server_info)
            await self.transport.publish(m.reply, orjson.dumps(info))

    async def _on_known_rids(self, m: Message) -> None:
        if m.reply:
            rids = orjson.loads(m.data)["rids"]
            known = await self.call(lambda s: s.known_rids(rids))
            answer = {"rids": known, "worker_id": self.cfg.worker_id}
            await self.transport.publish(m.reply, orjson.dumps(answer))

    async def _on_kv_snapshot(self, m: Message) -> None:
        """Every block this worker's cache holds, for a gateway that starts or missed an event."""
        if m.reply and self.kv_events is not None:
            snap = await self.call(self._kv_snapshot)
            await self.transport.publish(m.reply, encode(snap))

    def _kv_snapshot(self, sched: Scheduler) -> Any:
        """(scheduler thread) The changes not sent yet go out first (from this thread: in order with
        the step's messages), then the snapshot, as of that message."""
        assert self.kv_events is not None
        pending, snap = self.kv_events.snapshot(sched)
        if pending is not None:
            self._publish_soon(
                self.transport.publish(self.subjects.kv_events(pending.worker), encode(pending))
            )
        return snap

    async def _on_flush_cache(self, m: Message) -> None:
        if m.reply:
            ok = await self.call(self._flush_cache)
            answer = {"success": ok, "worker_id": self.cfg.worker_id}
            await self.transport.publish(m.reply, orjson.dumps(answer))

    def _flush_cache(self, sched: Scheduler) -> bool:
        ok = sched.flush_cache()
        if ok:
            self.metrics.refresh(sched, force=True)  # the next heartbeat shows the empty cache
        return ok

    def server_info(self, sched: Scheduler) -> dict[str, Any]:
        """Server arguments and live scheduler state, for /get_server_info and the gateway's checks."""
        mc = self.runner.model_config
        return {
            **dataclasses.asdict(self.cfg),
            "model_path": self.cfg.model_path or default_model_path(),
            "worker_id": self.cfg.worker_id,
            "context_length": self.runner.context_len,
            "vocab_size": mc.vocab_size,
            "max_total_tokens": sched.kv.size,
            "max_running_requests": sched.max_running,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "num_running_reqs": len(sched.running),
            "num_queue_reqs": len(sched.waiting),
            "num_used_tokens": sched.used_tokens(),
            "cache_hit_rate": sched.stats["cached_tokens"] / max(1, sched.stats["prompt_tokens"]),
            "last_gen_throughput": self.metrics.latest.get("gen_throughput", 0.0),
            "stats": dict(sched.stats),
            "kv_integrity_error": self.integrity_error,
        }

    def _put(self, fn: Callable[[], Any]) -> None:
        self._inbox.put(fn)
        self._wake.set()

    # -- the scheduler thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as e:  # the thread is dying: say so, so the process exits
            log.exception("the scheduler thread died")
            self._fail(f"scheduler {self.cfg.worker_id} stopped: {type(e).__name__}: {e}")

    def _steps(self) -> None:
        sched = self.scheduler
        # consumers in this process (the offline Engine's detokenizer and gateway) get the output
        # before the wait for the device, not during the next launch (Scheduler.step); over NATS they
        # are other processes, and the output goes at once
        early = self._send if self.transport.in_process else None
        while not self._stop.is_set():
            self._turned = time.monotonic()
            self._drain()
            self.metrics.refresh(sched)
            if sched.has_work:
                launched = sched.stats["steps"]
                try:
                    out = sched.step(early)
                except Exception as e:  # the whole step failed (per-request failures end one request)
                    log.exception("scheduler step failed; giving the running batch back and stopping")
                    reason = f"scheduler {self.cfg.worker_id} failed: {type(e).__name__}: {e}"
                    out, self._give_back = sched.fail_running(reason)
                    self._send(out)
                    self._fail(reason)
                    return
            else:
                out = sched.take_output()  # requests rejected on arrival
            self._send(out)
            self._send_kv_events()
            if out is not None:
                continue
            if sched.has_work and sched.stats["steps"] == launched:
                # requests wait only for work off this thread (a grammar compiling, a held request):
                # do not spin, which would keep that work from the GIL (the first grammar's backend
                # start took over 150 s so on 2 cores); a new request wakes this at once
                self._wake.wait(_WAITING_S)
                self._wake.clear()
            elif not sched.has_work:
                self.metrics.refresh(sched, force=True)  # idle: what the heartbeat carries is exact
                # the integrity check walks the whole pool: only after a quiet second, never between
                # a step's output and the next request
                if not self._wake.wait(_IDLE_CHECK_S):
                    self._idle_check()
                self._wake.clear()

    def _send(self, out: Any) -> None:
        if out is None:
            return
        detok = self.subjects.detok(self.cfg.worker_id)
        for data in encode_split(out, self.transport.max_payload):
            self._publish_soon(self.transport.publish(detok, data))

    def _send_kv_events(self) -> None:
        """(scheduler thread) The step's prefix-cache changes and the load, for the routers."""
        if self.kv_events is not None and (msg := self.kv_events.message(self.scheduler)) is not None:
            self._publish_soon(self.transport.publish(self.subjects.kv_events(msg.worker), encode(msg)))

    def _publish_soon(self, coro: Any) -> None:
        """(scheduler thread) Hand a bus coroutine to the event loop; they run in the order handed."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _fail(self, reason: str) -> None:
        assert self._loop is not None and self._failed is not None
        self._loop.call_soon_threadsafe(lambda: self._failed.done() or self._failed.set_result(reason))

    def _drain(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("scheduler inbox handler failed")

    def _idle_check(self) -> None:
        try:
            self.scheduler.check_integrity()
        except AssertionError as e:
            if self.integrity_error is None:
                log.error("%s", e)
            self.integrity_error = str(e)


def _drop_for(out_subjects: set[str], sched: Scheduler) -> list[str]:
    return sched.drop([r.rid for r in (*sched.waiting, *sched.running) if r.out_subject in out_subjects])


def _is_subject(subject: str) -> bool:
    """A concrete NATS subject to publish to: dot-separated non-empty tokens, no wildcards or spaces."""
    return bool(subject) and all(
        tok and tok not in ("*", ">") and not any(c.isspace() for c in tok) for tok in subject.split(".")
    )


def _set(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
