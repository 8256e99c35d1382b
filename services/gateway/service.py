"""The gateway process's core: request manager, bus API, worker liveness and scheduler info over the bus.
The HTTP layer (`http_app.py`) is a thin shell around it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import orjson

from services.gateway.bus_api import BusApi
from services.gateway.config import GatewayConfig
from services.gateway.request_manager import RequestManager
from shared.heartbeat import Heartbeat
from shared.model_config import ModelConfig
from shared.transport import Message, Subjects, Subscription, Transport

log = logging.getLogger(__name__)
_CTL_TIMEOUT_S = 5.0
_LOST_CHECK_S = 5.0  # requests without output for this long are checked against the scheduler


class Gateway:
    def __init__(self, cfg: GatewayConfig, transport: Transport, tokenizer: Any, model: ModelConfig,
                 model_path: str, tokenizer_path: str) -> None:  # fmt: skip
        self.cfg, self.transport, self.tokenizer = cfg, transport, tokenizer
        self.model, self.model_path, self.tokenizer_path = model, model_path, tokenizer_path
        self.subjects = Subjects(cfg.subject_prefix)
        self.requests = RequestManager(tokenizer, transport, cfg.subject_prefix, model.vocab_size,
                                       None, cfg.gateway_id)  # fmt: skip
        self.bus_api = BusApi(self.requests, transport, cfg.max_bus_request_bytes)
        self.scheduler_info: dict[str, Any] | None = None
        self._seen: dict[tuple[str, str], float] = {}  # (service, worker) -> last heartbeat
        self._dead_since: float | None = None  # when the last live pipeline went quiet
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task] = []
        self.started = time.time()
        self.served_model_name = os.path.splitext(os.path.basename(os.path.normpath(model_path)))[0]

    async def start(self) -> None:
        await self.requests.start()
        await self.requests.bodies.start()  # its child now, not at the first large body
        s = self.subjects
        # schedulers drop the requests of a gateway whose heartbeat stopped (its clients are gone)
        self._heartbeat = Heartbeat(self.transport, s.ctl("heartbeat"), "gateway", self.requests.out_subject,
                                    extra={"out_subject": self.requests.out_subject})  # fmt: skip
        self._heartbeat.start()
        self._subs.append(await self.transport.subscribe(s.ctl("heartbeat"), self._on_heartbeat))
        self._subs.append(
            await self.transport.subscribe(s.api_generate, self.bus_api.on_request, queue="gateways")
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch_workers()),
            loop.create_task(self._watch_lost_requests()),
            loop.create_task(self._fetch_info_until_ready()),
        ]

    async def stop(self) -> None:
        await self._heartbeat.stop()
        for t in self._tasks:
            t.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.bus_api.stop()
        await self.requests.stop()

    # -- control plane ------------------------------------------------------------------------
    async def ctl(self, what: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        data = await self.transport.request(
            self.subjects.ctl(what), orjson.dumps(payload or {}), _CTL_TIMEOUT_S
        )
        return orjson.loads(data)

    async def refresh_info(self) -> dict[str, Any]:
        info = await self.ctl("server_info")
        self.scheduler_info = info
        self.requests.context_len = info["context_length"]
        return info

    async def _fetch_info_until_ready(self) -> None:
        while self.scheduler_info is None:
            try:
                await self.refresh_info()
            except Exception:  # the scheduler is still loading its model
                await asyncio.sleep(0.5)

    @property
    def ready(self) -> bool:
        return self.scheduler_info is not None and self.pipeline_alive

    @property
    def pipeline_alive(self) -> bool:
        """Some worker has both a live scheduler and a live detokenizer."""
        now = time.monotonic()
        live = {(svc, w) for (svc, w), t in self._seen.items() if now - t < self.cfg.worker_timeout}
        return any(("detokenizer", w) in live for svc, w in live if svc == "scheduler")

    def why_down(self) -> str:
        """What /health and failed requests say when no pipeline is alive: the bus itself, or the
        workers whose heartbeats stopped."""
        if not self.transport.is_connected:
            return "the NATS bus is unreachable (the gateway is reconnecting to it)"
        if self.scheduler_info is None:
            return "the server is starting: no scheduler has answered yet"
        now = time.monotonic()
        dead = sorted(
            f"{svc} {w}" for (svc, w), t in self._seen.items() if now - t >= self.cfg.worker_timeout
        )
        if not dead:
            return "no live worker: no scheduler with a live detokenizer has sent a heartbeat"
        return f"no live worker: {', '.join(dead)} stopped answering for {self.cfg.worker_timeout:.0f} s"

    async def _on_heartbeat(self, m: Message) -> None:
        try:
            beat = orjson.loads(m.data)
            service, worker = beat["service"], beat["worker"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return
        if service in ("scheduler", "detokenizer") and isinstance(worker, str):
            self._seen[(service, worker)] = time.monotonic()

    async def _watch_lost_requests(self) -> None:
        """The work queue keeps a request until its output arrived here, and delivers it again when its
        scheduler died or its output was lost, so a request should never be lost. A safety net for
        what could still lose one (a NATS that restarted without its store): a request that no live
        scheduler has known for well over the redelivery time fails instead of waiting forever."""
        unknown_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(_LOST_CHECK_S)
            quiet = self.requests.quiet_rids(_LOST_CHECK_S)
            # known_rids asks one scheduler: with several workers a request could live on another one
            if not quiet or len({w for svc, w in self._seen if svc == "scheduler"}) != 1:
                unknown_since.clear()
                continue
            try:
                known = set((await self.ctl("known_rids", {"rids": quiet}))["rids"])
            except Exception:  # no scheduler answered in time (busy or down): the liveness check decides
                continue
            now = time.monotonic()
            unknown_since = {rid: unknown_since.get(rid, now) for rid in quiet if rid not in known}
            limit = 2 * (self.scheduler_info or {}).get("request_ack_wait", 30.0) + 2 * _LOST_CHECK_S
            lost = [rid for rid, t in unknown_since.items() if now - t > limit]
            if lost:
                log.error("%d requests were lost on the bus: %s", len(lost), lost[:5])
                message = (
                    f"the request was lost on the bus: no scheduler has it after {limit:.0f} s; send it again"
                )
                self.requests.fail(message, lost)

    async def _watch_workers(self) -> None:
        """When no pipeline is alive: a stream that sent tokens ends at once with an error naming the
        dead service (a restarted request samples anew); every other request waits for its worker to
        come back and the work queue to deliver it again, for at most `recovery_timeout`."""
        while True:
            await asyncio.sleep(0.5)
            if self.pipeline_alive or not self._seen:
                self._dead_since = None
                continue
            now = time.monotonic()
            self._dead_since = self._dead_since or now
            if not self.requests.in_flight:
                continue
            msg = self.why_down()
            if now - self._dead_since > self.cfg.recovery_timeout:
                rids, msg = self.requests.active_rids(), f"{msg}, and did not come back in time"
            else:
                rids = self.requests.streamed_rids()
            if rids:
                log.error("%s; failing %d in-flight requests", msg, len(rids))
                self.requests.fail(msg, rids)
                await self.requests.abort(rids)  # the scheduler may be alive: free its KV

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": [self.model.architecture],
        }
