"""The scheduler behind the bus: requests and aborts arrive on asyncio handlers, the model steps in one
dedicated thread (a forward never blocks the event loop), each step's output goes back as one message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import orjson

from services.scheduler.model_runner import ModelRunner
from services.scheduler.scheduler import Scheduler
from shared.config import EngineConfig
from shared.heartbeat import Heartbeat
from shared.messages import AbortReq, Decoder, GenerateReq, encode_split
from shared.model_files import default_model_path, resolve_model_folder
from shared.transport import Message, Subjects, Subscription, Transport

log = logging.getLogger(__name__)

_IDLE_CHECK_S = 1.0  # an idle scheduler checks KV integrity after this long without work


class SchedulerService:
    def __init__(self, config: EngineConfig, transport: Transport, runner: ModelRunner | None = None) -> None:
        self.cfg, self.transport = config, transport
        self.subjects = Subjects(config.subject_prefix)
        self.runner = runner or ModelRunner(
            config, resolve_model_folder(config.model_path, config.load_format != "dummy")
        )
        self.scheduler = Scheduler(config, self.runner)
        self._inbox: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subs: list[Subscription] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.integrity_error: str | None = None
        self._req_dec, self._abort_dec = Decoder(GenerateReq), Decoder(AbortReq)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.subjects
        self._subs.append(await self.transport.subscribe(s.req, self._on_req, queue="schedulers"))
        self._subs.append(await self.transport.subscribe(s.abort, self._on_abort))
        ctl = (("server_info", self._on_server_info), ("flush_cache", self._on_flush_cache),
               ("known_rids", self._on_known_rids))  # fmt: skip
        for what, handler in ctl:
            self._subs.append(await self.transport.subscribe(s.ctl(what), handler, queue="schedulers"))
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()
        self._heartbeat = Heartbeat(self.transport, s.ctl("heartbeat"), "scheduler", self.cfg.worker_id)
        self._heartbeat.start()

    async def stop(self) -> None:
        await self._heartbeat.stop()
        for sub in self._subs:
            await sub.unsubscribe()
        self._stop.set()
        self._wake.set()
        if self._thread:
            await asyncio.to_thread(self._thread.join)

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
    async def _on_req(self, m: Message) -> None:
        msg = self._req_dec(m.data)
        self._put(lambda: self.scheduler.add_request(msg))

    async def _on_abort(self, m: Message) -> None:
        msg = self._abort_dec(m.data)
        self._put(lambda: self.scheduler.abort(msg.rids, msg.finish, msg.reannounce))

    async def _on_server_info(self, m: Message) -> None:
        if m.reply:
            info = await self.call(self.server_info)
            await self.transport.publish(m.reply, orjson.dumps(info))

    async def _on_known_rids(self, m: Message) -> None:
        if m.reply:
            rids = orjson.loads(m.data)["rids"]
            known = await self.call(lambda s: s.known_rids(rids))
            await self.transport.publish(m.reply, orjson.dumps({"rids": known}))

    async def _on_flush_cache(self, m: Message) -> None:
        if m.reply:
            ok = await self.call(lambda s: s.flush_cache())
            await self.transport.publish(m.reply, orjson.dumps({"success": ok}))

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
            "num_used_tokens": sched.kv.size - sched.kv.free_count - sched.tree.evictable_size(),
            "cache_hit_rate": sched.stats["cached_tokens"] / max(1, sched.stats["prompt_tokens"]),
            "stats": dict(sched.stats),
            "kv_integrity_error": self.integrity_error,
        }

    def _put(self, fn: Callable[[], Any]) -> None:
        self._inbox.put(fn)
        self._wake.set()

    # -- the scheduler thread -----------------------------------------------------------------
    def _run(self) -> None:
        sched = self.scheduler
        detok = self.subjects.detok(self.cfg.worker_id)
        while not self._stop.is_set():
            self._drain()
            if sched.has_work:
                try:
                    out = sched.step()
                except Exception:
                    log.exception("scheduler step failed; aborting the running batch")
                    out = sched.fail_running("internal error in the scheduler step")
            else:
                out = sched.take_output()  # requests rejected on arrival
            if out is not None:
                for data in encode_split(out, self.transport.max_payload):
                    asyncio.run_coroutine_threadsafe(self.transport.publish(detok, data), self._loop)
            elif not sched.has_work:
                # the integrity check walks the whole pool: only after a quiet second, never between
                # a step's output and the next request
                if not self._wake.wait(_IDLE_CHECK_S):
                    self._idle_check()
                self._wake.clear()

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


def _set(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
