"""Ops endpoints (health, model and server info, flush_cache, abort_request) and what happens to the
scheduler's work when a streaming client goes away."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import POOL_TOKENS
from it_helpers import CONTEXT_LEN, PROMPT, VOCAB_SIZE, generate, greedy

LONG = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}


def test_health(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_model_info(client):
    for path in ("/get_model_info", "/model_info"):
        r = client.get(path)
        assert r.status_code == 200
        info = r.json()
        assert info["is_generation"] is True
        assert isinstance(info["model_path"], str) and info["model_path"]
        assert isinstance(info["tokenizer_path"], str) and info["tokenizer_path"]


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info(client, path):
    r = client.get(path)
    assert r.status_code == 200
    info = r.json()
    assert info["context_length"] == CONTEXT_LEN and info["vocab_size"] == VOCAB_SIZE
    assert info["max_total_tokens"] == POOL_TOKENS
    assert isinstance(info["version"], str)
    for key in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "cache_hit_rate", "stats"):
        assert key in info
    assert info["kv_integrity_error"] is None


def test_gateway_times_the_bus_path(srv, client):
    """gateway.stats.bus_s grows by at least the request's scheduler step time (the bus path holds it)."""
    srv.wait_idle()
    before = client.get("/get_server_info").json()
    generate(client, {"text": f"Bus path {uuid.uuid4().hex}", "sampling_params": greedy(2)})
    after = client.get("/get_server_info").json()
    bus = after["gateway"]["stats"]["bus_s"] - before["gateway"]["stats"]["bus_s"]
    step = after["stats"]["step_s"] - before["stats"]["step_s"]
    assert after["gateway"]["stats"]["finished"] == before["gateway"]["stats"]["finished"] + 1
    assert bus >= step > 0


def test_flush_cache_when_idle_empties_the_prefix_cache(srv, client):
    body = {"text": f"Flush test {uuid.uuid4().hex}: the weather today", "sampling_params": greedy(2)}
    generate(client, body)
    assert generate(client, body)["meta_info"]["cached_tokens"] > 0
    srv.wait_idle()
    r = client.post("/flush_cache")
    assert r.status_code == 200, r.text
    assert generate(client, body)["meta_info"]["cached_tokens"] == 0


def open_stream(http: httpx.Client, body: dict[str, Any]) -> tuple[Any, Iterator[str]]:
    """A streaming /generate left open; returns the context manager and an iterator of data payloads."""
    cm = http.stream("POST", "/generate", json={**body, "stream": True})
    r = cm.__enter__()
    assert r.status_code == 200

    def payloads() -> Iterator[str]:
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                yield line[6:]

    return cm, payloads()


def read_to_end(payloads: Iterator[str], first: int) -> tuple[list[dict], float]:
    """Reads the rest of a stream: its JSON chunks (after `first` already read) and when [DONE] came."""
    chunks = []
    for p in payloads:
        if p == "[DONE]":
            return chunks, time.monotonic()
        chunks.append(json.loads(p))
    raise AssertionError("the stream ended without [DONE]")


def wait_for_tokens(payloads: Iterator[str], n: int) -> dict:
    for _ in range(n):
        chunk = json.loads(next(payloads))
    return chunk


@pytest.mark.slow
def test_abort_request_ends_a_stream_with_abort_and_frees_kv(srv):
    rid = f"abort-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        cm, payloads = open_stream(http, {"text": PROMPT, "sampling_params": LONG, "rid": rid})
        try:
            assert wait_for_tokens(payloads, 3)["meta_info"]["finish_reason"] is None
            assert srv.info()["num_running_reqs"] == 1
            # the prefix cache cannot be flushed while a request runs
            r = http.post("/flush_cache")
            assert r.status_code == 400 and "running" in r.json()["error"]["message"]
            t0 = time.monotonic()
            assert http.post("/abort_request", json={"rid": rid}).status_code == 200
            chunks, done_at = read_to_end(payloads, 3)
        finally:
            cm.__exit__(None, None, None)
    assert done_at - t0 < 10
    last = chunks[-1]
    assert last["meta_info"]["id"] == rid
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 500
    srv.settle(timeout=10)


@pytest.mark.slow
def test_abort_all(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        streams = [open_stream(http, {"text": f"{PROMPT} {i}", "sampling_params": LONG}) for i in range(2)]
        try:
            for _, payloads in streams:
                wait_for_tokens(payloads, 2)
            assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
            ends = [read_to_end(payloads, 2)[0][-1] for _, payloads in streams]
        finally:
            for cm, _ in streams:
                cm.__exit__(None, None, None)
    assert [e["meta_info"]["finish_reason"]["type"] for e in ends] == ["abort", "abort"]
    srv.settle(timeout=10)


@pytest.mark.slow
def test_aborts_reach_only_the_callers_own_requests_and_a_rid_may_be_used_again(srv):
    """Another client (another token) aborting this rid, or everything, leaves the stream running; its
    own client's abort ends it, and the same rid sent again at once is a new request that completes
    (the rid is the client's label: the bus id is the gateway's own)."""
    rid = f"owned-{uuid.uuid4().hex[:8]}"
    alice, bob = ({"Authorization": f"Bearer {who}"} for who in ("alice", "bob"))
    with httpx.Client(base_url=srv.url, timeout=60, headers=alice) as http, \
            httpx.Client(base_url=srv.url, timeout=60, headers=bob) as other:  # fmt: skip
        cm, payloads = open_stream(http, {"text": PROMPT, "sampling_params": LONG, "rid": rid})
        try:
            wait_for_tokens(payloads, 2)
            assert other.post("/abort_request", json={"rid": rid}).status_code == 200
            assert other.post("/abort_request", json={"abort_all": True}).status_code == 200
            after = wait_for_tokens(payloads, 20)  # still running: bob's aborts found nothing of his
            assert after["meta_info"]["finish_reason"] is None
            assert http.post("/abort_request", json={"rid": rid}).status_code == 200
            chunks, _ = read_to_end(payloads, 3)
        finally:
            cm.__exit__(None, None, None)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        again = generate(http, {"text": PROMPT, "rid": rid, "sampling_params": greedy(4)})
    assert again["meta_info"]["id"] == rid and again["meta_info"]["finish_reason"]["type"] == "length"
    srv.settle(timeout=10)


def test_abort_request_bad_input_and_unknown_rid(client):
    assert client.post("/abort_request", json={"foo": 1}).status_code == 400
    r = client.post("/abort_request", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    assert client.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200


@pytest.mark.slow
def test_client_disconnect_mid_stream_frees_the_scheduler(srv):
    before = srv.wait_idle()["stats"]["generated_tokens"]
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        cm, payloads = open_stream(http, {"text": PROMPT, "sampling_params": LONG})
        wait_for_tokens(payloads, 3)
        cm.__exit__(None, None, None)  # closes the connection mid-stream
    deadline = time.monotonic() + 10
    while (info := srv.info())["num_running_reqs"] or info["gateway"]["in_flight"]:
        assert time.monotonic() < deadline, "the request kept running after its client went away"
        time.sleep(0.1)
    grew = info["stats"]["generated_tokens"] - before
    assert 3 <= grew < 400, grew
    srv.integrity()
    # the server is fine for the next client
    out = generate(srv.http, {"text": PROMPT, "sampling_params": greedy(2)})
    assert out["meta_info"]["completion_tokens"] == 2


@pytest.mark.slow
def test_client_disconnect_during_a_json_request_frees_the_scheduler(srv):
    """SGLang polls `request.is_disconnected()` while a non-streaming request waits and aborts it
    when the client has gone; the work must not run on for nobody."""
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    srv.wait_idle()
    try:
        with httpx.Client(base_url=srv.url, timeout=1.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/generate", json={"text": PROMPT, "sampling_params": LONG, "rid": rid})
        deadline = time.monotonic() + 10
        while (info := srv.info())["num_running_reqs"] or info["gateway"]["in_flight"]:
            assert time.monotonic() < deadline, (
                f"10 s after its client went away the request still runs: "
                f"{info['stats']['generated_tokens']} tokens generated so far"
            )
            time.sleep(0.2)
    finally:
        srv.http.post("/abort_request", json={"rid": rid})  # so the next tests find an idle server
