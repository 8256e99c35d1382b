"""The gateway process's core: request manager, bus API, worker liveness, and the control requests
that go to every live scheduler (server info, flush cache, the lost-request check; `fanout.py`) and
the metrics (`metrics.py`). The HTTP layer (`http_app.py`) is a thin shell around it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import orjson

from services.gateway.bus_api import BusApi
from services.gateway.config import GatewayConfig
from services.gateway.fanout import FanOut, combine_server_info, gather
from services.gateway.image_inputs import ImageInputs
from services.gateway.metrics import GatewayMetrics, checked_snapshot
from services.gateway.openai_serving import OpenAIServing
from services.gateway.request_manager import RequestManager
from services.gateway.router.router import Router
from shared.grammar_text import set_check_timeout
from shared.heartbeat import Heartbeat
from shared.model_config import ModelConfig
from shared.transport import Message, Subjects, Subscription, Transport

log = logging.getLogger(__name__)
_CTL_TIMEOUT_S = 5.0  # a live scheduler that has not answered a control request by then is reported
_LOST_CHECK_S = 5.0  # requests without output for this long are checked against the scheduler
ANSWER_S = 5.0  # after a drain, for the responses of the requests it ended to go out


class Gateway:
    def __init__(self, cfg: GatewayConfig, transport: Transport, tokenizer: Any, model: ModelConfig,
                 model_path: str, tokenizer_path: str,
                 images: ImageInputs | None = None) -> None:  # fmt: skip
        """images: a vision-language model's image handling (ImageInputs.from_folder); None: text only."""
        self.cfg, self.transport, self.tokenizer = cfg, transport, tokenizer
        self.model, self.model_path, self.tokenizer_path = model, model_path, tokenizer_path
        self.subjects = Subjects(cfg.subject_prefix)
        self.requests = RequestManager(tokenizer, transport, cfg.subject_prefix, model.vocab_size,
                                       None, cfg.gateway_id, cfg.reasoning_parser,
                                       cfg.max_request_states, cfg.max_inflight_requests,
                                       cfg.max_inflight_per_client, images=images)  # fmt: skip
        set_check_timeout(cfg.grammar_check_timeout)  # the grammar checks `requests` runs (grammar_text.py)
        self.openai = OpenAIServing(self.requests, lambda: (self.served_model_name, model_path, "default"),
                                    cfg.reasoning_parser)  # fmt: skip
        self.bus_api = BusApi(self.requests, transport, cfg.max_bus_request_bytes, self.openai)
        self.scheduler_info: dict[str, Any] | None = None
        self._seen: dict[tuple[str, str], float] = {}  # (service, worker) -> last heartbeat
        self._reports: dict[str, dict[str, Any]] = {}  # scheduler worker -> metrics of its last heartbeat
        self._dead_since: float | None = None  # when the last live pipeline went quiet
        self._subs: list[Subscription] = []
        self._api_subs: list[Subscription] = []  # the bus API's: left first when shutting down
        self._tasks: list[asyncio.Task] = []
        self.started = time.time()
        self.served_model_name = (
            cfg.served_model_name or os.path.splitext(os.path.basename(os.path.normpath(model_path)))[0]
        )
        self._peer_metrics: dict[str, tuple[float, list]] = {}  # other gateway -> (when, its request series)
        self.metrics = GatewayMetrics(self.served_model_name, self.scheduler_reports, self.peer_metrics)
        self.requests.metrics = self.metrics
        self.router = Router(cfg.router_policy, transport, self.subjects, self.live_workers,
                             cfg.router_balance_weight, self.requests.out_subject,
                             self.peer_gateways)  # fmt: skip
        self.router.on_route = lambda r: self.metrics.routed(cfg.router_policy, r.outcome, r.worker)
        self.requests.router = self.router
        self._gone: set[str] = set()  # workers dead past worker_recovery_timeout, forgotten by the router

    async def start(self) -> None:
        await self.requests.start()
        await self.requests.bodies.start()  # its child now, not at the first large body
        await self.router.start()
        s = self.subjects
        # schedulers drop the requests of a gateway whose heartbeat stopped (its clients are gone)
        # its request metrics go along: a scrape of any gateway sums every live gateway's (metrics.py)
        self._heartbeat = Heartbeat(self.transport, s.ctl("heartbeat"), "gateway", self.requests.out_subject,
                                    extra={"out_subject": self.requests.out_subject},
                                    report=lambda: {"request_metrics": self.metrics.snapshot()})  # fmt: skip
        self._heartbeat.start()
        self._subs.append(await self.transport.subscribe(s.ctl("heartbeat"), self._on_heartbeat))
        for subject, handler in ((s.api_generate, self.bus_api.on_request),
                                 (s.api_completions, self.bus_api.on_completion),
                                 (s.api_chat_completions, self.bus_api.on_chat_completion)):  # fmt: skip
            self._api_subs.append(await self.transport.subscribe(subject, handler, queue="gateways"))
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch_workers()),
            loop.create_task(self._watch_lost_requests()),
            loop.create_task(self._watch_routed()),
            loop.create_task(self._fetch_info_until_ready()),
        ]

    async def stop(self) -> None:
        await self._heartbeat.stop()
        for t in self._tasks:
            t.cancel()
        await self._leave(self._api_subs)
        await self._leave(self._subs)
        await self.router.stop()
        await self.bus_api.stop()
        await self.requests.stop()

    @staticmethod
    async def _leave(subs: list[Subscription]) -> None:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        subs.clear()

    @property
    def draining(self) -> str | None:
        """Why no new request is taken (the gateway is shutting down), or None."""
        return self.requests.refusing

    async def drain(self, timeout: float, now: asyncio.Event) -> None:
        """The graceful part of a shutdown: new requests get a 503 naming the reason (and /health too, so
        a load balancer stops sending), the bus API's subjects are left (other gateways take them), and
        the requests in flight may finish, for at most `timeout` seconds or until `now` is set (a
        second signal). Those still running then end with an error that says so (a JSON error; a
        stream's error event, then its end), and their schedulers are told to stop them."""
        self.requests.refusing = "the server is shutting down and takes no new requests"
        await self._leave(self._api_subs)
        if self.requests.in_flight:
            log.info("shutting down: %d requests in flight may finish within %g s",
                     self.requests.in_flight, timeout)  # fmt: skip
        await _until(lambda: not self.requests.in_flight, timeout, now)
        rids = self.requests.active_rids()
        if rids:
            if now.is_set():
                message = (
                    "the server is shutting down: a second signal ended the drain before the request finished"
                )
            else:
                message = (
                    "the server is shutting down: the request did not finish within the "
                    f"{timeout:g} s drain (shutdown_timeout)"
                )
            log.warning("shutting down: ending %d requests still running", len(rids))
            self.requests.fail(message, rids)
            await self.requests.abort(rids)
            await _until(lambda: not self.requests.in_flight, ANSWER_S)  # their answers go out

    # -- control plane ------------------------------------------------------------------------
    def live_schedulers(self) -> list[str]:
        """Scheduler workers whose heartbeat is recent (a fan-out waits for each of them)."""
        now = time.monotonic()
        return sorted(w for (svc, w), t in self._seen.items()
                      if svc == "scheduler" and now - t < self.cfg.worker_timeout)  # fmt: skip

    def peer_gateways(self) -> int:
        """Other gateways whose heartbeat is recent (the router then claims new prefixes on the bus)."""
        now = time.monotonic()
        return sum(now - t < self.cfg.worker_timeout for t, _ in self._peer_metrics.values())

    def live_workers(self) -> list[str]:
        """Workers that can serve now: a live scheduler and a live detokenizer (the router's choice)."""
        now, timeout = time.monotonic(), self.cfg.worker_timeout
        live = {(svc, w) for (svc, w), t in self._seen.items() if now - t < timeout}
        return sorted(w for svc, w in live if svc == "scheduler" and ("detokenizer", w) in live)

    def _silent_for(self, worker: str, now: float) -> float:
        """Seconds since the older of the worker's scheduler and detokenizer heartbeats."""
        seen = [self._seen.get((svc, worker)) for svc in ("scheduler", "detokenizer")]
        return now - min(t if t is not None else -1e18 for t in seen)

    async def _watch_routed(self) -> None:
        """Requests routed to a worker that died: a stream that sent tokens fails once the worker is
        dead (`worker_timeout`: its restart would sample anew); the others wait for it to come back
        for `worker_recovery_timeout`, then go to a live worker (taken back from the dead one's queue
        first, so a worker that returns later does not run them twice). The router forgets the blocks
        and load of a worker dead that long."""
        while True:
            await asyncio.sleep(0.5)
            now, known = time.monotonic(), {w for svc, w in self._seen if svc == "scheduler"}
            dead = {
                w: self._silent_for(w, now)
                for w in known
                if self._silent_for(w, now) >= self.cfg.worker_timeout
            }
            # given up on: its blocks and load no longer count (one that is only late keeps them)
            gone = {w for w, t in dead.items() if t >= self.cfg.worker_recovery_timeout}
            for w in gone - self._gone:
                self.router.forget(w)
            self._gone = gone
            if not dead or not self.requests.in_flight:
                continue
            streaming = set(self.requests.streamed_rids())
            for w in sorted(dead):
                streamed = sorted(streaming.intersection(self.requests.routed_to({w})))
                if streamed:
                    msg = f"worker {w} stopped answering for {self.cfg.worker_timeout:.0f} s"
                    log.error("%s; failing %d streams it was running", msg, len(streamed))
                    self.requests.fail(msg, streamed)
                    await self.requests.abort(streamed)
            late = {w for w, t in dead.items() if t >= self.cfg.worker_recovery_timeout}
            if late and self.live_workers():
                try:
                    moved = await self.requests.reroute(late)
                except Exception as e:  # the bus is down: the next turn tries again
                    log.warning("could not route the requests of dead worker(s) %s again: %s", late, e)
                    continue
                if moved:
                    log.warning("routed %d requests of dead worker(s) %s to live ones", moved,
                                ", ".join(sorted(late)))  # fmt: skip

    async def fan_out(self, what: str, payload: dict[str, Any] | None = None,
                      repeat: float | None = None) -> FanOut:  # fmt: skip
        """Ask every scheduler (`ctl.all.<what>`); the answers of those that answered within the
        timeout, and the live ones that did not. TimeoutError when none answered."""
        subject = self.subjects.ctl_all(what)
        expected = self.live_schedulers()
        return await gather(self.transport, subject, payload or {}, expected, _CTL_TIMEOUT_S, repeat)

    async def ctl(self, what: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """`fan_out`, where every live scheduler must answer (TimeoutError naming those that did not),
        the answers combined: a flag holds only if it holds on every worker (`success` of flush_cache),
        lists are joined, other values are the first worker's; `workers` has each worker's answer."""
        fan = await self.fan_out(what, payload)
        if fan.missing:
            raise TimeoutError(f"scheduler worker(s) {', '.join(fan.missing)} did not answer ctl.{what} "
                               f"within {_CTL_TIMEOUT_S:g} s")  # fmt: skip
        out: dict[str, Any] = {}
        for answer in fan.ordered():
            for key, value in answer.items():
                if key not in out:
                    out[key] = list(value) if isinstance(value, list) else value
                elif isinstance(value, bool):
                    out[key] = out[key] and value
                elif isinstance(value, list):
                    out[key] += value
        failed = [w for w, a in fan.answers.items() if any(v is False for v in a.values())]
        if failed:
            log.warning("ctl.%s failed on scheduler worker(s) %s", what, ", ".join(sorted(failed)))
        out["workers"] = fan.answers
        return out

    async def refresh_info(self, repeat: float | None = None) -> dict[str, Any]:
        """Every live scheduler's server_info, combined (`fanout.combine_server_info`); each worker's
        entry says whether its detokenizer is alive too (only then can it serve requests)."""
        info = combine_server_info(await self.fan_out("server_info", repeat=repeat))
        now = time.monotonic()
        for state in info["internal_states"]:
            seen = self._seen.get(("detokenizer", str(state.get("worker_id"))))
            state["detokenizer_alive"] = seen is not None and now - seen < self.cfg.worker_timeout
        info["router"] = self.router.info()
        self.scheduler_info = info
        self.requests.context_len = info["context_length"]
        return info

    def scheduler_reports(self) -> dict[str, dict[str, Any]]:
        """The metrics on the last heartbeat of each live scheduler (for /metrics)."""
        return {w: self._reports[w] for w in self.live_schedulers() if self._reports.get(w)}

    async def _fetch_info_until_ready(self) -> None:
        """Asked every half second while the schedulers load their model (one that subscribes after a
        fan-out went out never sees it); answers to earlier asks still count."""
        while self.scheduler_info is None:
            try:
                await self.refresh_info(repeat=0.5)
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
        """What /health says when it answers 503: shutting down, or why no pipeline is alive."""
        return self.draining if self.draining is not None else self.why_workers_down()

    def why_workers_down(self) -> str:
        """What failed requests say when no pipeline is alive: the bus itself, or the workers whose
        heartbeats stopped (a drain beside it is not the cause)."""
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
        now = time.monotonic()
        if service == "gateway" and worker != self.requests.out_subject:
            if beat.get("leaving"):
                self._peer_metrics.pop(worker, None)
            elif "request_metrics" in beat:
                self._peer_metrics[worker] = (now, checked_snapshot(beat["request_metrics"]))
            return
        if service not in ("scheduler", "detokenizer") or not isinstance(worker, str):
            return
        if beat.get("leaving"):  # it stopped on purpose: no fan-out waits for it, no metrics from it
            self._seen[(service, worker)] = now - self.cfg.worker_timeout
            if service == "scheduler":
                self._reports.pop(worker, None)
            return
        self._seen[(service, worker)] = now
        if service == "scheduler" and isinstance(beat.get("metrics"), dict):
            self._reports[worker] = beat["metrics"]

    def peer_metrics(self) -> list[list]:
        """The request series of the other gateways that beat lately (for /metrics)."""
        gone = time.monotonic() - self.cfg.worker_timeout
        for worker in [w for w, (seen, _) in self._peer_metrics.items() if seen < gone]:
            del self._peer_metrics[worker]
        return [series for _, series in self._peer_metrics.values()]

    async def _watch_lost_requests(self) -> None:
        """The work queue keeps a request until its output arrived here, and delivers it again when its
        scheduler died or its output was lost, so a request should never be lost. A safety net for
        what could still lose one (a NATS that restarted without its store): a request that no live
        scheduler has known for well over the redelivery time fails instead of waiting forever."""
        unknown_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(_LOST_CHECK_S)
            quiet = self.requests.quiet_rids(_LOST_CHECK_S)
            if not quiet:
                unknown_since.clear()
                continue
            try:  # every live scheduler is asked: a request may run on any of them
                fan = await self.fan_out("known_rids", {"rids": quiet})
            except Exception:  # no scheduler answered in time (busy or down): the liveness check decides
                continue
            if fan.missing:  # a live scheduler did not answer: it may hold them
                continue
            known = {rid for answer in fan.answers.values() for rid in answer.get("rids", ())}
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
            msg = self.why_workers_down()
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
            "has_image_understanding": self.requests.images is not None,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": [self.model.architecture],
        }


async def _until(done: Callable[[], bool], timeout: float, cut: asyncio.Event | None = None) -> None:
    """Until done(), `timeout` seconds passed, or `cut` is set."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline and not (cut is not None and cut.is_set()):
        await asyncio.sleep(0.05)
