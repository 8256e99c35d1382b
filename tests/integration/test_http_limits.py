"""HTTP limits of the served gateway: bodies that are not JSON on POST (what a web page can make a
browser send without asking) are a 415, a Host header naming another host is a 403 on a server bound
to loopback (DNS rebinding), JSON nested past what a parser can take is a 400, and /health_generate
runs one probe for a crowd of callers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from it_helpers import greedy

GEN = {"text": "Hello", "sampling_params": greedy(2)}


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/abort_request"])
def test_a_post_declared_as_not_json_is_a_415(
    srv, client: httpx.Client, path: str, content_type: str
) -> None:
    r = client.post(path, content=b'{"rid": "x"}', headers={"content-type": content_type})
    assert r.status_code == 415, r.text
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_json_with_or_without_a_content_type_is_served(srv, client: httpx.Client) -> None:
    import orjson

    for headers in ({"content-type": "application/json; charset=utf-8"}, {}):
        r = client.post("/generate", content=orjson.dumps(GEN), headers=headers)
        assert r.status_code == 200, r.text


def test_a_foreign_host_header_is_refused_on_loopback(srv, client: httpx.Client) -> None:
    port = srv.port
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        r = client.post("/flush_cache", headers={"host": host})
        assert r.status_code == 403, (host, r.text)
        assert client.get("/get_model_info", headers={"host": host}).status_code == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"):
        assert client.get("/health", headers={"host": host}).status_code == 200, host


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/abort_request"])
def test_deeply_nested_json_is_a_400(srv, client: httpx.Client, path: str) -> None:
    body = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert client.get("/health").status_code == 200


def test_health_generate_is_one_probe_for_a_crowd(srv, client: httpx.Client) -> None:
    before = client.get("/get_server_info").json()["gateway"]["stats"]["finished"]
    with ThreadPoolExecutor(32) as pool, httpx.Client(base_url=srv.url, timeout=60) as c:
        codes = list(pool.map(lambda _: c.get("/health_generate").status_code, range(64)))
    assert codes == [200] * 64
    probes = client.get("/get_server_info").json()["gateway"]["stats"]["finished"] - before
    assert 1 <= probes < 32  # 64 callers, a few probes (one per flight; a flight answers for a second)
