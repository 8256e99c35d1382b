"""The bus API as an internal service uses it: nats-py straight to `sglbus.api.generate`, no HTTP.
Same request JSON, same response shape and the same 400 messages as `/generate`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import nats
import orjson
import pytest
import pytest_asyncio
from it_helpers import META_KEYS, PROMPT, check_cumulative, generate, greedy, same_output

pytestmark = pytest.mark.asyncio
SUBJECT = "sglbus.api.generate"
DONE = b"[DONE]"


@pytest_asyncio.fixture
async def nc(srv) -> AsyncIterator[nats.NATS]:
    conn = await nats.connect(srv.nats_url, name="test-bus-api", token=srv.nats_token)
    yield conn
    await conn.close()


async def request(nc: nats.NATS, body: dict | bytes, timeout: float = 60) -> dict:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    msg = await nc.request(SUBJECT, data, timeout=timeout)
    return orjson.loads(msg.data)


async def request_stream(nc: nats.NATS, body: dict | bytes, timeout: float = 60) -> list[bytes]:
    """Publish with a reply inbox; every message that arrives on it, up to and including [DONE]."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    await nc.publish(SUBJECT, data, reply=inbox)
    got = []
    try:
        while not got or got[-1] != DONE:
            got.append((await sub.next_msg(timeout=timeout)).data)
    finally:
        await sub.unsubscribe()
    return got


async def test_request_reply_matches_http(client, nc):
    body = {"text": PROMPT, "sampling_params": greedy(6, ignore_eos=True)}
    out = await request(nc, body)
    assert set(out) == {"text", "output_ids", "meta_info"} and set(out["meta_info"]) == META_KEYS
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert same_output(out, await asyncio.to_thread(generate, client, body))


async def test_batch_and_rid(nc):
    out = await request(nc, {"text": [PROMPT, "Hello"], "rid": "busbatch", "sampling_params": greedy(2)})
    assert [r["meta_info"]["id"] for r in out] == ["busbatch_0", "busbatch_1"]
    assert all(len(r["output_ids"]) == 2 for r in out)


async def test_stream_chunks_arrive_as_separate_messages(nc):
    body = {"text": PROMPT, "sampling_params": greedy(8, ignore_eos=True)}
    msgs = await request_stream(nc, {**body, "stream": True})
    assert msgs[-1] == DONE and DONE not in msgs[:-1]
    chunks = [json.loads(m) for m in msgs[:-1]]
    assert len(chunks) >= 2
    last = check_cumulative(chunks)
    assert same_output(last, await request(nc, body))


async def test_concurrent_bus_requests(nc):
    bodies = [{"text": f"Count to {i}:", "sampling_params": greedy(3)} for i in range(6)]
    together = await asyncio.gather(*(request(nc, b) for b in bodies))
    for b, out in zip(bodies, together, strict=True):
        assert same_output(out, await request(nc, b))


BAD_BODIES = {
    "invalid_json": b'{"text": ',
    "empty": b"",
    "top_p_zero": orjson.dumps({"text": "hi", "sampling_params": {"top_p": 0}}),
    "unknown_field": orjson.dumps({"text": "hi", "max_tokens": 3}),
    "empty_text": orjson.dumps({"text": ""}),
    "not_yet": orjson.dumps({"text": "hi", "sampling_params": {"structural_tag": "{}"}}),
    "bad_regex": orjson.dumps({"text": "hi", "sampling_params": {"regex": "[0-9"}}),
    "b64_without_flat": orjson.dumps(
        {"text": "hi", "return_logprob": True, "return_flat_raw_top_logprobs_b64": True}
    ),
    "too_long": orjson.dumps({"input_ids": [1] * 9000}),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
async def test_bad_input_gets_the_http_400_message(client, nc, case):
    body = BAD_BODIES[case]
    http = await asyncio.to_thread(
        client.post, "/generate", content=body, headers={"content-type": "application/json"}
    )
    assert http.status_code == 400
    out = await request(nc, body)
    assert out == {"error": {"message": http.json()["error"]["message"], "code": 400}}


@pytest.mark.parametrize(
    "body",
    [
        {"text": "hi", "stream": True, "sampling_params": {"top_p": 0}},  # fails in validation
        {"text": "", "stream": True},  # fails in parsing
        {"text": "hi", "stream": True, "max_tokens": 3},  # fails in parsing
    ],
    ids=["bad_sampling", "empty_text", "unknown_field"],
)
async def test_bad_streaming_input_gets_an_error_then_done(nc, body):
    msgs = await request_stream(nc, body, timeout=3)
    assert len(msgs) == 2 and msgs[1] == DONE
    err = orjson.loads(msgs[0])["error"]
    assert err["code"] == 400 and err["message"]


async def test_openai_endpoints_on_the_bus_answer_as_over_http(client, nc):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    msg = await nc.request("sglbus.api.chat_completions", orjson.dumps(body), timeout=60)
    out = orjson.loads(msg.data)
    http = (await asyncio.to_thread(client.post, "/v1/chat/completions", json=body)).json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == http["choices"][0]["message"]
    assert out["usage"]["completion_tokens"] == http["usage"]["completion_tokens"]
    assert http["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the bus request's prompt, cached
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(
        "sglbus.api.completions",
        orjson.dumps({"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}),
        reply=inbox,
    )
    got = []
    while not got or got[-1] != DONE:
        got.append((await sub.next_msg(timeout=60)).data)
    await sub.unsubscribe()
    full = (
        await asyncio.to_thread(
            client.post, "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        )
    ).json()
    assert "".join(orjson.loads(m)["choices"][0]["text"] for m in got[:-1]) == full["choices"][0]["text"]
    bad = orjson.loads(
        (await nc.request("sglbus.api.completions", b'{"prompt": "x", "n": 0}', timeout=30)).data
    )
    assert bad["error"]["param"] == "n" and bad["error"]["type"] == "invalid_request_error"


async def test_zero_new_tokens_reads_the_next_token_top_logprobs(client, nc):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "top_logprobs_num": 2}  # fmt: skip
    out = await request(nc, body)
    http = await asyncio.to_thread(generate, client, body)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    (top,) = out["meta_info"]["output_top_logprobs"]
    assert [e[1] for e in top] == [e[1] for e in http["meta_info"]["output_top_logprobs"][0]]
