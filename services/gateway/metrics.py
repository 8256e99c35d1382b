"""`GET /metrics`: SGLang's Prometheus metrics for the whole deployment, served by the gateway.

Two sources, one text exposition:
- what this gateway observes of its own requests (SGLang's TokenizerMetricsCollector): time to first
  token, inter-token latency and end-to-end latency histograms; prompt, generation and cached token
  counters, requests and aborted requests. Labels: model_name, engine_type, worker (the worker whose
  detokenizer sent the request's output; empty for a request that got none).
- what each scheduler reports on its heartbeat (SGLang's SchedulerMetricsCollector: running and queued
  requests, KV pool, prefix cache hit rate, generation throughput, retractions, grammar compile time),
  for every scheduler with a live heartbeat. Labels: model_name, engine_type, tp_rank, pp_rank, worker.

Every gateway serves the same scheduler series. The request series add up the requests of every live
gateway of the deployment: each gateway sends its own series on its heartbeat (`snapshot`), and a
scrape of any one of them (`sglbus serve --tokenizer-worker-num` puts several behind one port, where
a scrape reaches one at random) sums its own and the others' last ones; a gateway that stopped beating
drops out of the sums. Counters and histograms only, without their `_created` samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response

from shared.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

if TYPE_CHECKING:
    from services.gateway.service import Gateway

ENGINE_TYPE = "unified"  # SGLang's label for a server that does prefill and decode alike
GATEWAY_LABELS = ("model_name", "engine_type", "worker")
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "worker")

# (key in the scheduler's heartbeat `metrics`, metric name, help): SGLang's names and help texts
_GAUGES = (
    ("num_running_reqs", "sglang:num_running_reqs", "The number of running requests."),
    ("num_queue_reqs", "sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    ("num_used_tokens", "sglang:num_used_tokens", "The number of used tokens."),
    ("token_usage", "sglang:token_usage", "The token usage."),
    ("kv_used_tokens", "sglang:kv_used_tokens",
     "KV pool tokens held by running requests or locked in the prefix cache."),
    ("kv_available_tokens", "sglang:kv_available_tokens", "Free KV pool tokens."),
    ("kv_evictable_tokens", "sglang:kv_evictable_tokens",
     "KV pool tokens of the prefix cache that can be evicted."),
    ("max_total_num_tokens", "sglang:max_total_num_tokens",
     "Maximum total number of tokens in the KV cache pool."),
    ("cache_hit_rate", "sglang:cache_hit_rate", "The prefix cache hit rate."),
    ("gen_throughput", "sglang:gen_throughput", "The generation throughput (token/s)."),
)  # fmt: skip
_COUNTERS = (("retractions", "sglang:num_retracted_requests", "Total number of retracted requests."),)
_HISTOGRAMS = (
    ("grammar_compilation_time", "sglang:grammar_compilation_time_seconds",
     "Histogram of grammar compilation time in seconds."),
)  # fmt: skip


def scheduler_families(snapshots: dict[str, dict[str, Any]], model_name: str) -> list[Metric]:
    """The scheduler metrics of these workers (worker id -> the `metrics` of its last heartbeat), one
    family per metric with one sample set per worker. A key a snapshot lacks is left out for it."""
    workers = sorted(snapshots)
    labels = {w: [model_name, ENGINE_TYPE, "0", "0", w] for w in workers}
    out: list[Metric] = []
    for family, specs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
        for key, name, doc in specs:
            metric = family(name, doc, labels=SCHEDULER_LABELS)
            for w in workers:
                if isinstance(value := snapshots[w].get(key), int | float):
                    metric.add_metric(labels[w], value)
            out.append(metric)
    for key, name, doc in _HISTOGRAMS:
        hist = HistogramMetricFamily(name, doc, labels=SCHEDULER_LABELS)
        for w in workers:
            h = snapshots[w].get(key)
            if isinstance(h, dict):
                buckets = [(floatToGoString(le), n) for le, n in zip(h["le"], h["cumulative"], strict=True)]
                hist.add_metric(labels[w], [*buckets, ("+Inf", h["count"])], h["sum"])
        out.append(hist)
    return out


class _SchedulerCollector:
    """A prometheus_client collector over the schedulers' latest heartbeats, read at each scrape."""

    def __init__(self, snapshots: Callable[[], dict[str, dict[str, Any]]], model_name: str) -> None:
        self.snapshots, self.model_name = snapshots, model_name

    def describe(self) -> list[Metric]:  # registering must not read the snapshots
        return []

    def collect(self) -> Iterator[Metric]:
        yield from scheduler_families(self.snapshots(), self.model_name)


# one sample of a gateway's request series on its heartbeat: [family, sample name, labels, value]
Sample = list[Any]


def checked_snapshot(raw: Any) -> list[Sample]:
    """The well-formed samples of another gateway's snapshot (it came over the bus: never trusted)."""
    if not isinstance(raw, list):
        return []
    return [x for x in raw if isinstance(x, list) and len(x) == 4 and isinstance(x[0], str)
            and isinstance(x[1], str) and isinstance(x[2], dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in x[2].items())
            and isinstance(x[3], int | float) and not isinstance(x[3], bool)]  # fmt: skip


class _RequestCollector:
    """This gateway's request series plus the other live gateways' (their heartbeats' snapshots)."""

    def __init__(self, own: CollectorRegistry, peers: Callable[[], list[list[Sample]]]) -> None:
        self.own, self.peers = own, peers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        others: dict[str, dict[tuple[str, tuple], float]] = {}  # family -> (sample, labels) -> sum
        for snapshot in self.peers():
            for family, name, labels, value in snapshot:
                key = (name, tuple(sorted(labels.items())))
                into = others.setdefault(family, {})
                into[key] = into.get(key, 0.0) + value
        for fam in self.own.collect():
            merged = Metric(fam.name, fam.documentation, fam.type)
            extra = others.get(fam.name, {})
            for sample in fam.samples:
                if not sample.name.endswith("_created"):
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    merged.add_sample(sample.name, sample.labels, sample.value + extra.pop(key, 0.0))
            for (name, labels), value in extra.items():  # series only other gateways have
                merged.add_sample(name, dict(labels), value)
            yield merged


class GatewayMetrics:
    """The gateway's metric registry (private: several gateways or engines in one process are fine).
    `peers`: the request-series snapshots of the other live gateways."""

    def __init__(
        self,
        model_name: str,
        snapshots: Callable[[], dict[str, dict[str, Any]]],
        peers: Callable[[], list[list[Sample]]] = list,
    ) -> None:
        self.model_name = model_name
        self._own = reg = CollectorRegistry()  # this gateway's request series

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, GATEWAY_LABELS, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, GATEWAY_LABELS, buckets=buckets, registry=reg)

        # SGLang's names and help texts
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed."
        )
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )
        self.routes = Counter("sglbus:router_requests", "Requests routed, by worker and outcome (hit: to the "
                              "worker holding most of the prompt; miss: none held any; imbalance: load sent "
                              "it elsewhere; shared: to the shared queue).",
                              ("model_name", "policy", "outcome", "worker"), registry=reg)  # fmt: skip
        self.registry = CollectorRegistry()
        self.registry.register(_RequestCollector(self._own, peers))
        self.registry.register(_SchedulerCollector(snapshots, model_name))

    def snapshot(self) -> list[Sample]:
        """This gateway's request series, for its heartbeat."""
        return [[fam.name, s.name, s.labels, s.value] for fam in self._own.collect() for s in fam.samples
                if not s.name.endswith("_created")]  # fmt: skip

    def _labels(self, worker: str) -> tuple[str, str, str]:
        return self.model_name, ENGINE_TYPE, worker

    def first_token(self, worker: str, seconds: float) -> None:
        self.ttft.labels(*self._labels(worker)).observe(seconds)

    def inter_token(self, worker: str, seconds: float, tokens: int) -> None:
        """`tokens` arrived together after `seconds`: each counts seconds / tokens (as SGLang does)."""
        hist = self.itl.labels(*self._labels(worker))
        for _ in range(tokens):
            hist.observe(seconds / tokens)

    def request_done(self, worker: str, prompt: int, completion: int, cached: int, e2e: float | None,
                     aborted: bool) -> None:  # fmt: skip
        """Once per request, when the gateway is done with it; `e2e` is None when it did not finish
        (its client went away)."""
        labels = self._labels(worker)
        self.prompt_tokens.labels(*labels).inc(prompt)
        self.generation_tokens.labels(*labels).inc(completion)
        self.cached_tokens.labels(*labels).inc(cached)
        self.requests.labels(*labels).inc()
        if aborted:
            self.aborted.labels(*labels).inc()
        if e2e is not None:
            self.e2e.labels(*labels).observe(e2e)

    def routed(self, policy: str, outcome: str, worker: str | None) -> None:
        self.routes.labels(self.model_name, policy, outcome, worker or "").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_route(gw: Gateway) -> Callable[[Request], Any]:
    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return metrics
