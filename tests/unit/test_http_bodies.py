"""Request bodies at the gateway: one over `max_body_bytes` gets a 413 naming the limit, in each API's
error shape (declared or not, on every route that reads a body); an OpenAI body from OFF_LOOP_BYTES on
is decoded and checked on the tokenizer's threads while the event loop keeps answering, with the
result it would have had in place."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import orjson
import pytest
from starlette.testclient import TestClient

import services.gateway.openai_serving as serving_module
from services.gateway.config import GatewayConfig
from services.gateway.http_app import build_app
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_serving import OFF_LOOP_BYTES, OpenAIServing
from services.gateway.request_manager import RequestManager
from shared.transport import InProcessTransport

LIMIT = 4096
MODELS = ("served",)
NATIVE = ("/generate", "/abort_request")
OPENAI = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/detokenize")


@pytest.fixture
def client() -> Iterator[TestClient]:
    """The HTTP app over a gateway that is never reached: a body over the limit stops before it."""

    def untouched(*args, **kwargs):
        raise AssertionError("a body over the limit reached the gateway")

    requests = SimpleNamespace(bodies=SimpleNamespace(parse=untouched), off_loop=untouched)
    gw = SimpleNamespace(cfg=GatewayConfig(max_body_bytes=LIMIT), requests=requests,
                         openai=SimpleNamespace(parse=untouched))  # fmt: skip
    with TestClient(build_app(gw), base_url="http://127.0.0.1") as c:
        yield c


def _chunks() -> Iterator[bytes]:
    """A chunked upload declares no length; the limit holds while it arrives."""
    yield b'{"text": "'
    for _ in range(8):
        yield b"a" * 1024
    yield b'"}'


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", NATIVE + OPENAI)
def test_a_body_over_the_limit_is_413_naming_it(client: TestClient, path: str, declared: bool) -> None:
    body = b'{"text": "' + b"a" * (2 * LIMIT) + b'"}' if declared else _chunks()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert f"limit of {LIMIT} bytes" in err["message"] and "max_body_bytes" in err["message"]
    if path in NATIVE:  # the native shape: {"error": {"message", "code"}, "object", "message"}
        assert err["code"] == 413 and r.json()["object"] == "error"
    else:  # OpenAI's: {"error": {"message", "type", "param", "code"}}
        assert err["type"] == "invalid_request_error" and err["param"] is None


@pytest.fixture
def serving() -> Iterator[OpenAIServing]:
    requests = RequestManager(None, InProcessTransport(), "sglbus", 1000)
    yield OpenAIServing(requests, lambda: MODELS)
    requests._pool.shutdown(wait=True)


def _completion(n_ids: int, **extra) -> bytes:
    return orjson.dumps({"model": "served", "prompt": [i % 1000 for i in range(n_ids)], "rid": "r", **extra})


def test_a_large_openai_body_parses_on_the_tokenizer_threads_with_the_same_result(serving, monkeypatch):
    threads: list[str] = []
    real = serving_module.parse_completion

    def parse_completion(body, models):
        threads.append(threading.current_thread().name)
        return real(body, models)

    monkeypatch.setattr(serving_module, "parse_completion", parse_completion)
    small, large = _completion(10), _completion(20_000, max_tokens=3)
    assert len(small) < OFF_LOOP_BYTES <= len(large)

    async def parse_both():
        return await serving.parse("completion", small), await serving.parse("completion", large)

    (_, (small_req, small_gen)), (stream, (req, gen)) = asyncio.run(parse_both())
    assert threads[0] == threading.current_thread().name  # in place: the hop would cost more
    assert threads[1].startswith("tokenize")  # RequestManager.off_loop's threads
    assert not stream and gen.prompts[0].input_ids == [i % 1000 for i in range(20_000)]
    assert serving.parse_here("completion", large) == (False, (req, gen))
    assert small_gen.prompts[0].input_ids == list(range(10)) and small_req.n == 1


def test_the_event_loop_keeps_answering_while_a_large_body_parses(serving):
    """~1.5 MiB of ids: decoding and checking it takes the loop for ~50 ms when done in place."""
    body = _completion(250_000)

    async def parse_with_a_ticker():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        _, parsed = await serving.parse("completion", body)
        done.set()
        await task
        return ticks - before, parsed

    ticks, parsed = asyncio.run(parse_with_a_ticker())
    assert not isinstance(parsed, OpenAIError)
    assert ticks > 10, ticks  # in place: 1 (nothing else runs until the parse returns)


@pytest.mark.parametrize(
    "data, stream, param",
    [
        (b'{"prompt": "x", "stream": true, "n": 0}', True, "n"),
        (b'{"prompt": "x", "stream": false, "bogus": 1}', False, "bogus"),
        (b'{"prompt": "x", "stream": ', True, None),  # invalid JSON: the stream flag is a guess
        (
            orjson.dumps({"prompt": "x", "stream": True, "sampling_params": {}}) + b" " * OFF_LOOP_BYTES,
            True,
            "sampling_params",
        ),  # fmt: skip
    ],
)
def test_a_refused_body_says_whether_it_asked_for_a_stream(serving, data, stream, param):
    got_stream, parsed = asyncio.run(serving.parse("completion", data))
    assert got_stream is stream and isinstance(parsed, OpenAIError) and parsed.param == param


def test_a_body_that_trickles_in_is_refused_after_the_timeout():
    """A client that sends a byte now and then holds its connection no longer than the timeout: 408."""
    import asyncio

    from starlette.requests import Request

    from services.gateway.http_util import BodyTooSlow, read_json

    async def trickle():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b" ", "more_body": True}

    async def run():
        scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"1000")]}
        with pytest.raises(BodyTooSlow) as err:
            await read_json(Request(scope, trickle), 1 << 20, timeout=0.3)
        assert err.value.status == 408 and "not complete after 0 s" in str(err.value)

    asyncio.run(run())
