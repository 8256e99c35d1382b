"""`GET /metrics` (SGLang's Prometheus metrics) and the ops that go to every worker, on the shared
server: the gateway's request counters move by exactly what the responses report, the schedulers'
series arrive on their heartbeats, and a second worker (a scheduler + detokenizer pair started here,
on the same NATS, and stopped again at the end of the module) gets its own `worker` label, its own
entry in /get_server_info's `internal_states`, and its cache flushed by /flush_cache."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from conftest import POOL_TOKENS, ROOT, ServerProcs
from it_helpers import generate, greedy, stream
from prometheus_client.parser import text_string_to_metric_families

HEARTBEAT_WAIT_S = 15.0  # scheduler series come with heartbeats (one a second)


class Scrape:
    """One /metrics answer, parsed by prometheus_client's own parser."""

    def __init__(self, http: httpx.Client) -> None:
        r = http.get("/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        self.samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]

    def series(self, name: str) -> list[dict[str, str]]:
        return [s.labels for s in self.samples if s.name == name]

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())


def wait_for(cond: Callable[[], Any], what: str, timeout: float = HEARTBEAT_WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return value


def served_model_name(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_metrics_count_what_the_responses_report(srv, client):
    srv.wait_idle()
    before = Scrape(client)
    tag = uuid.uuid4().hex
    first = {"text": f"Metrics {tag}: the weather in Paris today is", "sampling_params": greedy(4)}
    outs = [generate(client, first), generate(client, first)]  # the repeat hits the prefix cache
    outs.append(generate(client, {"text": f"Metrics {tag}: a second prompt", "sampling_params": greedy(3)}))
    outs.append(stream(client, {"text": f"Metrics {tag}: streamed", "sampling_params": greedy(3)})[-1])
    metas = [o["meta_info"] for o in outs]
    assert metas[1]["cached_tokens"] > 0
    after = Scrape(client)

    def grew(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    assert grew("sglang:prompt_tokens_total", worker="0") == sum(m["prompt_tokens"] for m in metas)
    assert grew("sglang:generation_tokens_total", worker="0") == sum(m["completion_tokens"] for m in metas)
    assert grew("sglang:cached_tokens_total", worker="0") == sum(m["cached_tokens"] for m in metas)
    assert grew("sglang:num_requests_total") == 4
    assert grew("sglang:num_aborted_requests_total") == 0
    assert grew("sglang:time_to_first_token_seconds_count", worker="0") == 4
    assert grew("sglang:e2e_request_latency_seconds_count", worker="0") == 4
    # one token per step and output message: every token after the first is one inter-token latency
    assert grew("sglang:inter_token_latency_seconds_count") == sum(m["completion_tokens"] - 1 for m in metas)
    name = served_model_name(client)
    labels = after.series("sglang:prompt_tokens_total")
    assert labels and all(lb["model_name"] == name and lb["engine_type"] == "unified" for lb in labels)
    ttft_le = {lb["le"] for lb in after.series("sglang:time_to_first_token_seconds_bucket")}
    assert {"0.1", "0.2", "1.0", "400.0", "+Inf"} <= ttft_le  # SGLang's buckets

    # the scheduler's series, from its heartbeat once it is idle again
    def idle_with_cache() -> Scrape | None:
        m = Scrape(client)
        running = m.series("sglang:num_running_reqs")
        if running and m.total("sglang:num_running_reqs") == 0 and m.total("sglang:kv_evictable_tokens") > 0:
            return m
        return None

    m = wait_for(idle_with_cache, "an idle scheduler holding the prompts in its prefix cache")
    assert m.series("sglang:num_running_reqs") == [
        {"model_name": name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "worker": "0"}
    ]
    total = m.total("sglang:max_total_num_tokens", worker="0")
    assert total == POOL_TOKENS
    used, evictable = m.total("sglang:kv_used_tokens"), m.total("sglang:kv_evictable_tokens")
    assert used == m.total("sglang:num_used_tokens") == 0
    assert used + evictable + m.total("sglang:kv_available_tokens") == total
    assert m.total("sglang:token_usage") == used / total
    assert m.total("sglang:num_queue_reqs") == 0
    assert 0 <= m.total("sglang:cache_hit_rate") <= 1 and m.total("sglang:gen_throughput") >= 0
    assert m.series("sglang:num_retracted_requests_total")


def test_grammar_compilation_time_is_observed(srv, client):
    def compiles() -> float:
        return Scrape(client).total("sglang:grammar_compilation_time_seconds_count", worker="0")

    before = compiles()
    regex = f"(yes|no|{uuid.uuid4().hex[:8]})"  # a grammar no earlier request compiled
    out = generate(client, {"text": "Answer:", "sampling_params": greedy(16, regex=regex)})
    assert out["text"] in regex.strip("()").split("|")
    wait_for(lambda: compiles() == before + 1, "the compile reported on a heartbeat")
    buckets = Scrape(client).series("sglang:grammar_compilation_time_seconds_bucket")
    assert {"0.0", "0.01", "240.0", "+Inf"} <= {b["le"] for b in buckets}  # SGLang's buckets


# -- a second worker --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def second_worker(server: ServerProcs) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Worker "1" (a scheduler and its detokenizer) on the shared server's NATS, until the module ends
    (or the last test stops it)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("scheduler", "detokenizer"):
            command = [*server.command(name), "--worker-id", "1"]
            with open(os.path.join(server.logdir, f"{name}-1.log"), "ab") as log:
                procs.append(subprocess.Popen(command, cwd=ROOT, env=server.env, stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        # both parts: a request its scheduler took before its detokenizer listened would wait for the
        # work queue's redelivery
        ready = lambda: [(s["worker_id"], s["detokenizer_alive"]) for s in server.info()["internal_states"]]
        wait_for(lambda: ready() == [("0", True), ("1", True)] or any(p.poll() is not None for p in procs),
                 "worker 1 answering", timeout=120)  # fmt: skip
        assert all(p.poll() is None for p in procs), server.tail("scheduler-1") + server.tail("detokenizer-1")
        yield procs
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_a_second_worker_has_its_own_series_and_server_info(server, second_worker, client):
    info = server.info()
    assert [s["worker_id"] for s in info["internal_states"]] == ["0", "1"] and info["missing_workers"] == []
    assert all(s["max_total_tokens"] == POOL_TOKENS for s in info["internal_states"])
    assert info["max_total_tokens"] == POOL_TOKENS and info["worker_id"] == "0"  # the top level as before
    assert info["num_running_reqs"] == sum(s["num_running_reqs"] for s in info["internal_states"])

    def both() -> Scrape | None:
        m = Scrape(client)
        return m if {lb["worker"] for lb in m.series("sglang:max_total_num_tokens")} == {"0", "1"} else None

    m = wait_for(both, "scheduler series of both workers")
    assert m.total("sglang:max_total_num_tokens", worker="1") == POOL_TOKENS
    assert {lb["worker"] for lb in m.series("sglang:grammar_compilation_time_seconds_count")} == {"0", "1"}

    # requests go to either worker: together they count what the responses report
    before = Scrape(client)
    tag = uuid.uuid4().hex
    metas = [generate(client, {"text": f"Two workers {tag} {i}:", "sampling_params": greedy(2)})["meta_info"]
             for i in range(4)]  # fmt: skip
    after = Scrape(client)
    grew = after.total("sglang:prompt_tokens_total") - before.total("sglang:prompt_tokens_total")
    assert grew == sum(m["prompt_tokens"] for m in metas)
    assert {lb["worker"] for lb in after.series("sglang:prompt_tokens_total")} <= {"", "0", "1"}


def test_flush_cache_reaches_every_worker(server, second_worker, client):
    server.wait_idle()
    flushes = {s["worker_id"]: s["stats"]["cache_flushes"] for s in server.info()["internal_states"]}
    r = client.post("/flush_cache")
    assert r.status_code == 200, r.text
    after = {s["worker_id"]: s["stats"]["cache_flushes"] for s in server.info()["internal_states"]}
    assert set(after) == {"0", "1"} and after == {w: n + 1 for w, n in flushes.items()}

    def emptied() -> bool:
        m = Scrape(client)
        workers = {lb["worker"] for lb in m.series("sglang:kv_evictable_tokens")}
        return workers == {"0", "1"} and m.total("sglang:kv_evictable_tokens") == 0

    wait_for(emptied, "both prefix caches empty on the heartbeats")


def test_the_samples_of_n_go_to_the_worker_that_prefilled_their_prompt(server, second_worker, client):
    """n > 1: the prompt's prefill and its samples are one delivery, so with two workers every sample
    still finds the whole prompt (but the token it recomputes for its logits) in its prefix cache."""
    tag = uuid.uuid4().hex
    for i in range(3):
        body = {"text": f"Samples {tag} {i}: once upon a time", "sampling_params": {**greedy(2), "n": 4}}
        outs = generate(client, body)
        assert len(outs) == 4
        for out in outs:
            meta = out["meta_info"]
            assert meta["cached_tokens"] >= meta["prompt_tokens"] - 1, meta


def test_a_stopped_worker_leaves_the_fan_out_at_once(server, second_worker, client):
    """(last in the module) A worker stopped with SIGTERM says goodbye on its way out: its series go
    and /get_server_info neither waits for it nor reports it missing, well before its heartbeat would
    have timed out (5 s)."""
    stop(second_worker)
    gone = lambda: "1" not in {lb["worker"] for lb in Scrape(client).series("sglang:max_total_num_tokens")}
    wait_for(gone, "worker 1's series gone after its goodbye", timeout=3)
    info = server.info()
    assert [s["worker_id"] for s in info["internal_states"]] == ["0"] and info["missing_workers"] == []
