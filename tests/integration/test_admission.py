"""Admission control on the served system: one request asking for millions of states (a 1 MiB body of
250,000 prompts with n 128) is answered 400 at once, naming the bound, while /health keeps answering
and another client's request is served; a 503 says when to retry."""

from __future__ import annotations

import threading

import httpx
import orjson
from it_helpers import generate, greedy

from services.gateway.http_util import json_response


def test_millions_of_states_in_one_request_are_a_400_and_nobody_notices(srv, client: httpx.Client) -> None:
    body = orjson.dumps({"input_ids": [[1]] * 250_000, "sampling_params": {"n": 128, "max_new_tokens": 1}})
    assert len(body) < 4 << 20
    health: list[int] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while not done.is_set():
                health.append(c.get("/health").status_code)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    finally:
        done.set()
        prober.join()
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "max_request_states" in message and "250000 x 128 = 32000000" in message
    assert health and set(health) == {200}
    out = generate(client, {"text": "The capital of France is", "sampling_params": greedy(4)})
    assert out["meta_info"]["completion_tokens"] == 4


def test_a_503_says_when_to_retry() -> None:
    r = json_response({"error": "busy"}, 503)
    assert r.headers["retry-after"] == "1"
    assert "retry-after" not in json_response({}, 400).headers


def test_a_schema_whose_refs_multiply_is_a_400_at_once(srv, client: httpx.Client) -> None:
    """5 KB of $refs reusing definitions down 40 levels (2^40 nodes expanded): refused before any
    grammar library expands it, and the server goes on serving."""
    defs = {f"L{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/L{i + 1}"},
            "b": {"$ref": f"#/$defs/L{i + 1}"}}} for i in range(40)}  # fmt: skip
    defs["L40"] = {"type": "string"}
    schema = orjson.dumps({"$defs": defs, "$ref": "#/$defs/L0"}).decode()
    r = client.post(
        "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, "json_schema": schema}}
    )
    assert r.status_code == 400, r.text
    assert "with every $ref expanded" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
