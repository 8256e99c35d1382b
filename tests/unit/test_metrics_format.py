"""The parts of /metrics and of the fan-out that need no model: SGLang's metric names and labels in
the text exposition (parsed back with prometheus_client's own parser), the bucket counter the
scheduler ships on its heartbeat, gathering answers from several workers over the in-process bus, the
combined /get_server_info of several workers, and the API key over /metrics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.testclient import TestClient

from services.gateway.fanout import FanOut, combine_server_info, gather
from services.gateway.http_auth import OPEN_PATHS, AuthGate
from services.gateway.metrics import GatewayMetrics, checked_snapshot, metrics_route, scheduler_families
from shared.messages import BatchTextOut, Decoder, TextOut, encode_split
from shared.metrics import GRAMMAR_COMPILE_BUCKETS, BucketCounts
from shared.transport import InProcessTransport, Message


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for every sample of the exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def snapshot(running: int, compile_times: list[float]) -> dict:
    counts = BucketCounts(GRAMMAR_COMPILE_BUCKETS)
    for t in compile_times:
        counts.observe(t)
    return {"num_running_reqs": running, "num_queue_reqs": 2, "token_usage": 0.25, "kv_used_tokens": 4,
            "kv_available_tokens": 10, "kv_evictable_tokens": 2, "max_total_num_tokens": 16,
            "cache_hit_rate": 0.5, "gen_throughput": 12.5, "retractions": 3,
            "grammar_compilation_time": counts.snapshot()}  # fmt: skip


def sched_labels(worker: str) -> tuple[tuple[str, str], ...]:
    labels = {"model_name": "m", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "worker": worker}
    return tuple(sorted(labels.items()))


def test_bucket_counts_are_cumulative_with_le_semantics() -> None:
    counts = BucketCounts((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        counts.observe(v)
    snap = counts.snapshot()
    assert snap["le"] == [0.1, 1.0]
    assert snap["cumulative"] == [2, 4]  # 0.1 lands in le=0.1, 1.0 in le=1.0
    assert snap["count"] == 5 and snap["sum"] == 0.05 + 0.1 + 0.5 + 1.0 + 7.0


def test_scheduler_families_one_series_per_worker() -> None:
    registry = CollectorRegistry()

    class Source:
        def collect(self):
            return scheduler_families({"1": snapshot(1, [0.003, 0.3]), "0": snapshot(5, [])}, "m")

    registry.register(Source())
    got = samples(generate_latest(registry).decode())
    assert got[("sglang:num_running_reqs", sched_labels("0"))] == 5
    assert got[("sglang:num_running_reqs", sched_labels("1"))] == 1
    assert got[("sglang:kv_available_tokens", sched_labels("1"))] == 10
    assert got[("sglang:gen_throughput", sched_labels("0"))] == 12.5
    assert got[("sglang:num_retracted_requests_total", sched_labels("1"))] == 3
    # SGLang's buckets, cumulative, with +Inf, sum and count
    le = dict(sched_labels("1"))
    bucket = lambda b: got[
        ("sglang:grammar_compilation_time_seconds_bucket", tuple(sorted({**le, "le": b}.items())))
    ]
    assert bucket("0.0") == 0 and bucket("0.01") == 1 and bucket("0.2") == 1 and bucket("0.5") == 2
    assert bucket("240.0") == 2 and bucket("+Inf") == 2
    assert got[("sglang:grammar_compilation_time_seconds_count", sched_labels("1"))] == 2
    assert abs(got[("sglang:grammar_compilation_time_seconds_sum", sched_labels("1"))] - 0.303) < 1e-9
    # a key the snapshot lacks is left out, not reported as 0
    assert ("sglang:num_used_tokens", sched_labels("0")) not in got


def test_gateway_metrics_count_requests_and_share_inter_token_latency() -> None:
    metrics = GatewayMetrics("m", lambda: {"0": snapshot(0, [])})
    metrics.first_token("0", 0.3)
    metrics.inter_token("0", 0.5, 2)  # two tokens after 0.5 s: two observations of 0.25 s
    metrics.request_done("0", prompt=7, completion=3, cached=6, e2e=0.9, aborted=False)
    metrics.request_done("", prompt=4, completion=0, cached=0, e2e=None, aborted=True)
    got = samples(metrics.render().decode())
    w0 = (("engine_type", "unified"), ("model_name", "m"), ("worker", "0"))
    none = (("engine_type", "unified"), ("model_name", "m"), ("worker", ""))
    assert got[("sglang:prompt_tokens_total", w0)] == 7 and got[("sglang:prompt_tokens_total", none)] == 4
    assert got[("sglang:generation_tokens_total", w0)] == 3
    assert got[("sglang:cached_tokens_total", w0)] == 6
    assert got[("sglang:num_requests_total", w0)] == 1
    assert (
        got[("sglang:num_aborted_requests_total", none)] == 1
        and ("sglang:num_aborted_requests_total", w0) not in got  # a series starts at its first abort
    )
    assert got[("sglang:time_to_first_token_seconds_count", w0)] == 1
    assert got[("sglang:inter_token_latency_seconds_count", w0)] == 2
    assert got[("sglang:inter_token_latency_seconds_sum", w0)] == 0.5
    itl_bucket = lambda le: got[
        ("sglang:inter_token_latency_seconds_bucket", tuple(sorted((*w0, ("le", le)))))
    ]
    assert itl_bucket("0.2") == 0 and itl_bucket("0.4") == 2
    assert got[("sglang:e2e_request_latency_seconds_count", w0)] == 1
    assert ("sglang:e2e_request_latency_seconds_count", none) not in got  # it never finished
    assert got[("sglang:num_running_reqs", sched_labels("0"))] == 0  # the schedulers' series too


def test_split_text_output_keeps_its_worker() -> None:
    """The gateway labels a request's metrics with the worker of its output messages, split or not."""
    batch = BatchTextOut(
        outs=[TextOut(rid=f"r{i}", text="x" * 400, output_ids=[1]) for i in range(4)], worker="7"
    )
    parts = [Decoder(BatchTextOut)(data) for data in encode_split(batch, 1000)]
    assert len(parts) > 1 and {p.worker for p in parts} == {"7"}
    assert [o.rid for p in parts for o in p.outs] == ["r0", "r1", "r2", "r3"]


async def answer_as(bus: InProcessTransport, worker: str) -> None:
    async def on(m: Message) -> None:
        assert m.reply is not None
        await bus.publish(m.reply, orjson.dumps({"worker_id": worker, "asked": orjson.loads(m.data)}))

    await bus.subscribe("sglbus.ctl.all.server_info", on)


def test_gather_waits_for_the_expected_workers_and_names_the_missing() -> None:
    async def run() -> FanOut:
        bus = InProcessTransport()
        await answer_as(bus, "0")
        await answer_as(bus, "1")
        return await gather(bus, "sglbus.ctl.all.server_info", {"q": 1}, ["0", "1", "2"], timeout=0.3)

    fan = asyncio.run(run())
    assert sorted(fan.answers) == ["0", "1"] and fan.missing == ["2"]
    assert fan.answers["1"]["asked"] == {"q": 1}


def test_gather_without_an_answer_times_out() -> None:
    async def run() -> FanOut:
        return await gather(InProcessTransport(), "sglbus.ctl.all.server_info", {}, [], timeout=0.1)

    with pytest.raises(TimeoutError):
        asyncio.run(run())


def test_gather_repeats_for_a_worker_that_subscribes_late() -> None:
    async def run() -> FanOut:
        bus = InProcessTransport()

        async def late() -> None:
            await asyncio.sleep(0.2)
            await answer_as(bus, "0")

        task = asyncio.ensure_future(late())
        fan = await gather(bus, "sglbus.ctl.all.server_info", {}, [], timeout=5, repeat=0.05)
        await task
        return fan

    assert list(asyncio.run(run()).answers) == ["0"]


def test_combined_server_info_sums_the_load_and_lists_each_worker() -> None:
    def info(worker: str, running: int, prompt: int, cached: int, error: str | None = None) -> dict:
        ctx = 8192 if worker == "0" else 4096
        return {"worker_id": worker, "max_total_tokens": 100, "context_length": ctx,
                "num_running_reqs": running, "num_queue_reqs": 1, "num_used_tokens": 10 * running,
                "last_gen_throughput": 2.0, "kv_integrity_error": error,
                "stats": {"prompt_tokens": prompt, "cached_tokens": cached, "step_s": 0.5}}  # fmt: skip

    fan = FanOut({"1": info("1", 2, 30, 10, "KV leak"), "0": info("0", 1, 10, 10)}, ["2"])
    top = combine_server_info(fan)
    assert top["worker_id"] == "0" and top["max_total_tokens"] == 100  # the first worker's own fields
    assert (top["num_running_reqs"], top["num_queue_reqs"], top["num_used_tokens"]) == (3, 2, 30)
    assert top["stats"] == {"prompt_tokens": 40, "cached_tokens": 20, "step_s": 1.0}
    assert top["cache_hit_rate"] == 0.5 and top["last_gen_throughput"] == 4.0
    assert top["context_length"] == 4096  # what fits every worker
    assert top["kv_integrity_error"] == "worker 1: KV leak"
    assert [s["worker_id"] for s in top["internal_states"]] == ["0", "1"]
    assert top["missing_workers"] == ["2"]


def test_a_gateway_sums_the_request_series_of_the_other_gateways() -> None:
    """Several gateways behind one port: a scrape reaches one of them, and shows every gateway's
    requests (the others' come as snapshots on their heartbeats), without `_created` samples."""
    a = GatewayMetrics("m", dict)
    peers: list[list] = []
    b = GatewayMetrics("m", dict, lambda: peers)
    a.request_done("0", prompt=7, completion=3, cached=2, e2e=0.9, aborted=False)
    a.request_done("1", prompt=5, completion=1, cached=0, e2e=0.1, aborted=True)  # a series b lacks
    a.first_token("0", 0.3)
    b.request_done("0", prompt=4, completion=2, cached=1, e2e=2.0, aborted=False)
    b.first_token("0", 0.05)
    assert orjson.loads(orjson.dumps(a.snapshot())) == a.snapshot()  # it travels as JSON
    peers.append(orjson.loads(orjson.dumps(a.snapshot())))
    text = b.render().decode()
    got = samples(text)
    w = lambda worker, *more: tuple(sorted((("engine_type", "unified"), ("model_name", "m"),
                                             ("worker", worker), *more)))  # fmt: skip
    assert got[("sglang:prompt_tokens_total", w("0"))] == 11
    assert got[("sglang:num_requests_total", w("0"))] == 2
    assert got[("sglang:prompt_tokens_total", w("1"))] == 5
    assert got[("sglang:num_aborted_requests_total", w("1"))] == 1
    assert got[("sglang:e2e_request_latency_seconds_count", w("0"))] == 2
    assert got[("sglang:e2e_request_latency_seconds_sum", w("0"))] == 2.9
    ttft = lambda le: got[("sglang:time_to_first_token_seconds_bucket", w("0", ("le", le)))]
    assert ttft("0.1") == 1 and ttft("0.4") == 2 and ttft("+Inf") == 2
    assert "_created" not in text
    # a malformed snapshot off the bus loses its bad samples, never the scrape
    bad = [["sglang:prompt_tokens", "sglang:prompt_tokens_total", {"worker": 1}, 5], ["x"], 7,
           ["sglang:prompt_tokens", "sglang:prompt_tokens_total", {}, "5"]]  # fmt: skip
    assert checked_snapshot(bad) == [] and checked_snapshot({"a": 1}) == []
    assert checked_snapshot(a.snapshot()) == a.snapshot()
    peers.clear()  # that gateway stopped beating: only b's own requests are left
    assert samples(b.render().decode())[("sglang:prompt_tokens_total", w("0"))] == 4
    assert ("sglang:prompt_tokens_total", w("1")) not in samples(b.render().decode())


def test_metrics_needs_the_api_key() -> None:
    assert "/metrics" not in OPEN_PATHS
    gw = SimpleNamespace(metrics=GatewayMetrics("m", dict))
    app = Starlette(
        routes=[Route("/metrics", metrics_route(gw))], middleware=[Middleware(AuthGate, api_key="k")]
    )
    http = TestClient(app, base_url="http://127.0.0.1")
    assert http.get("/metrics").status_code == 401
    r = http.get("/metrics", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"sglang:prompt_tokens", "sglang:time_to_first_token_seconds", "sglang:num_running_reqs"} <= names
