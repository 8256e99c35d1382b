"""Fuzzing the served system: whatever arrives over HTTP or straight on the bus, the server answers a
request with a result or a 4xx naming the problem, never a 5xx, never a hang, and afterwards it is
healthy, gives the same greedy output as before and holds no KV."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import nats
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from it_helpers import PROMPT, VOCAB_SIZE

from shared.messages import BatchTextOut, Decoder, GenerateReq

pytestmark = pytest.mark.slow

ANSWER_TIMEOUT_S = 60.0
REFERENCE = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
# no shrinking: a hang costs ANSWER_TIMEOUT_S a try, and the failing body is reported as it was
FUZZ_HTTP = settings(
    max_examples=120, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def reference_output(server, client: httpx.Client) -> tuple[str, list[int]]:
    try:
        r = client.post("/generate", json=REFERENCE)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {ANSWER_TIMEOUT_S} s to {REFERENCE}\n{server.tails()}")
    assert r.status_code == 200, f"{r.text}\n{server.tails()}"
    return r.json()["text"], r.json()["output_ids"]


@contextmanager
def new_tracebacks(server) -> Iterator[list[str]]:
    """Collects (on exit) the tracebacks the services logged meanwhile: an exception a handler only
    logged still left its message unhandled. Each kind (log line, exception type) with its count and
    its first full text."""
    sizes = {name: _size(server.log_path(name)) for name in server.procs}
    found: list[str] = []
    yield found
    for name, start in sizes.items():
        with open(server.log_path(name), errors="replace") as f:
            f.seek(start)
            lines = f.read().splitlines()
        first: dict[str, str] = {}
        count: Counter[str] = Counter()
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                end = next(
                    (j for j in range(i + 1, len(lines)) if not lines[j].startswith(" ")), len(lines) - 1
                )
                logged = lines[i - 1].split(" ", 4)[-1] if i else ""
                key = f"{logged} -> {lines[end].split(':', 1)[0]}"  # the exception's type
                count[key] += 1
                first.setdefault(key, "\n".join(lines[max(0, i - 1) : end + 1]))
        found += [f"{name}: {n} x {key}\n{first[key]}" for key, n in count.items()]


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def assert_healthy_after(server, client: httpx.Client, before: tuple[str, list[int]]) -> None:
    assert all(p.poll() is None for p in server.procs.values()), server.tails()
    assert client.get("/health").status_code == 200, server.tails()
    assert reference_output(server, client) == before, "greedy output changed after the fuzz"
    server.settle()


# -- HTTP ---------------------------------------------------------------------------------------------
EDGE_INTS = [
    0, 1, -1, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1,
]  # fmt: skip
EDGE_FLOATS = [0.0, -0.0, 1e-7, 0.5, 1.0, 2.0, 2.5, -1.0, 1e308, math.nan, math.inf, -math.inf]
EDGE_TEXT = ["", " ", "a", "0", "-0", "5", "49152", "٣", "²", "\x00", "<|im_end|>", "é" * 3, "\U0001f600"]

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from(EDGE_INTS)
    | st.sampled_from(EDGE_FLOATS)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def pick(*choices: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One of the strategies, each as likely (st.one_of favours the ones that draw less)."""
    return st.sampled_from(choices).flatmap(lambda s: s)


# mostly plain values, one in four at an edge (NaN and inf only in `anything`: they make a body invalid JSON)
ints = pick(*[st.integers(0, 5)] * 3, st.sampled_from([-1, *EDGE_INTS]))
floats = pick(*[st.floats(0, 1)] * 3, st.sampled_from([-1.0, -0.0, 1e-7, 1.5, 2.5, 1e308]))
texts = pick(*[st.text(min_size=1, max_size=6)] * 3, st.sampled_from(EDGE_TEXT))
ids = st.lists(pick(*[st.integers(0, 1000)] * 5, st.sampled_from(EDGE_INTS)), min_size=1, max_size=6)
# what a request may generate stays small: the fuzz is about the edges, not about long outputs
max_new_tokens = pick(*[st.integers(0, 4)] * 4, st.sampled_from([-1, 2**63, 2**64 - 1, 10**6, "2", 1.5]))
SAMPLING = {
    "min_new_tokens": st.integers(0, 2) | ints,
    "temperature": pick(st.sampled_from([0, 0.7, 1.0]), floats),
    "top_p": floats,
    "top_k": ints,
    "min_p": floats,
    "frequency_penalty": floats,
    "presence_penalty": floats,
    "repetition_penalty": floats,
    "stop": texts | st.lists(texts, max_size=2),
    "stop_token_ids": st.lists(ints, max_size=2) | ints,
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "n": pick(st.just(1), st.just(2), st.sampled_from([0, -1, 128, 129, 2**63, "2", 1.5])),
    "sampling_seed": ints,
    "logit_bias": st.dictionaries(pick(*[ints.map(str)] * 3, texts), floats, max_size=2),
    "regex": pick(*[st.none()] * 3, texts),  # a grammar when it parses, else a 400
    "custom_params": st.dictionaries(st.text(max_size=4), anything, max_size=2),
    "stream_interval": ints,
}
REQUEST = {
    "rid": texts | st.lists(texts, max_size=3),
    "return_logprob": pick(*[st.booleans()] * 3, st.lists(st.booleans(), max_size=3)),
    "logprob_start_len": ints,
    "top_logprobs_num": st.integers(0, 3) | ints,
    "token_ids_logprob": st.lists(ints, max_size=3),
    "return_text_in_logprobs": st.booleans(),
    "return_flat_raw_top_logprobs": st.booleans(),
    "return_flat_raw_top_logprobs_b64": st.booleans(),
    "image_data": pick(*[st.none()] * 3, texts),
    "log_metrics": pick(*[st.booleans()] * 3, anything),
}


@st.composite
def some(draw: st.DrawFn, values: dict[str, st.SearchStrategy[Any]], max_size: int) -> dict[str, Any]:
    """A few fields with values of their type (often at an edge) or null; now and then one with any
    value at all, or a name that does not exist."""
    keys = draw(st.lists(st.sampled_from(sorted(values)), unique=True, max_size=max_size))
    out = {k: draw(values[k] | st.none()) for k in keys}
    if draw(st.integers(0, 5)) == 0:
        out[draw(st.sampled_from([*values, "nonsense"]))] = draw(anything)
    return out


prompt_texts = st.just(PROMPT) | st.text(min_size=1, max_size=8) | texts


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(
        pick(
            st.fixed_dictionaries({"text": prompt_texts}),
            st.fixed_dictionaries({"text": prompt_texts}),
            st.fixed_dictionaries({"text": st.lists(prompt_texts, min_size=1, max_size=3)}),
            st.fixed_dictionaries({"input_ids": ids}),
            st.fixed_dictionaries({"input_ids": ids}),
            st.fixed_dictionaries({"input_ids": st.lists(ids, min_size=1, max_size=2)}),
            st.fixed_dictionaries({}, optional={"text": anything, "input_ids": anything}),
        )
    )
    sampling = {"max_new_tokens": draw(max_new_tokens), **draw(some(SAMPLING, 4))}
    body = {**prompt, **draw(some(REQUEST, 2)), "sampling_params": sampling}
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = draw(st.just(True) | anything)
    return body


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()  # NaN and inf as the bare words, which are not JSON: a 400


raw_bodies = st.one_of(
    st.binary(max_size=48),
    st.text(max_size=24).map(str.encode),
    st.tuples(near_valid().map(_encode), st.integers(0, 40)).map(lambda t: t[0][: t[1]]),  # cut short
    st.sampled_from([b"[]", b"null", b'"text"', b"1e999", b"[" * 5000 + b"]" * 5000, b'{"text": "\\ud800"}',
                     b'{"text": "hi", "text": 5}', b'{"input_ids": [18446744073709551616]}', b"\xff\xfe{}"]),
)  # fmt: skip
bodies = pick(near_valid(), near_valid(), near_valid(), raw_bodies)


def check_answer(server, client: httpx.Client, body: dict[str, Any] | bytes) -> None:
    content = body if isinstance(body, bytes) else _encode(body)
    streaming = isinstance(body, dict) and body.get("stream") is True
    headers = {"content-type": "application/json"}
    started = time.monotonic()
    try:
        with client.stream("POST", "/generate", content=content, headers=headers) as r:
            raw = r.read()
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {ANSWER_TIMEOUT_S} s to {content[:300]!r}\n{server.tails()}")
    took = time.monotonic() - started
    assert r.status_code == 200 or 400 <= r.status_code < 500, (
        f"HTTP {r.status_code} for {content[:300]!r}: {raw[:500]!r}\n{server.tails()}"
    )
    if r.status_code != 200:
        message = json.loads(raw)["error"]["message"]
        assert isinstance(message, str) and message, raw
        return
    if streaming:
        assert r.headers["content-type"].startswith("text/event-stream"), raw[:300]
        assert raw.endswith(b"data: [DONE]\n\n"), f"stream cut short after {took:.1f} s: {raw[-300:]!r}"
        assert b'{"error"' not in raw, f"an error inside the stream of {content[:300]!r}: {raw[:500]!r}"
    else:
        out = json.loads(raw)
        for item in out if isinstance(out, list) else [out]:
            assert isinstance(item["text"], str) and "meta_info" in item, raw[:300]


def hi(**sampling: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}}


# failures seen before (and the cheapest bodies), tried first on every run
@example(body=b"")
@example(body=b"{")
@example(body={**hi(), "text": "\x14", "stream": True})  # a text of no tokens
@example(body=hi(n=2**64 - 1))  # n samples are n requests
@example(body=hi(sampling_seed=2**64 - 1, temperature=1))
@example(body=hi(max_new_tokens=2**63 - 1))
@example(body={"input_ids": [2**64 - 1], "sampling_params": {"max_new_tokens": 1}})
@example(body={**hi(top_p=0), "stream": True})
@FUZZ_HTTP
@given(body=bodies)
def _fuzz_http(server, client, body) -> None:
    check_answer(server, client, body)


def test_http_fuzz_never_5xx_nor_a_hang(server):
    client = httpx.Client(base_url=server.url, timeout=ANSWER_TIMEOUT_S)
    try:
        before = reference_output(server, client)
        with new_tracebacks(server) as tracebacks:
            _fuzz_http(server, client)
        assert not tracebacks, "\n".join(tracebacks)
        assert_healthy_after(server, client, before)
    finally:
        client.close()


# -- raw bus messages ---------------------------------------------------------------------------------
N_BUS_REQUESTS = 200
BAD_SUBJECTS = [
    "", " ", "a b", ">", "*", "a..b", "sglbus.req", "sglbus.abort", "sglbus.detok.0", "sglbus.out.x",
]  # fmt: skip


# values of the right type, at or beyond the edges of what is allowed (the scheduler's own checks)
SAMPLING_EDGES: dict[str, list[Any]] = {
    "temperature": [math.nan, math.inf, -1.0, 0.0, 0.7, 1e308],
    "top_p": [math.nan, 0.0, 1.5, 0.9],
    "top_k": [0, -2, 1, 2**63 - 1, VOCAB_SIZE + 1],
    "min_p": [math.nan, -0.1, 0.5, 2.0],
    "repetition_penalty": [0.0, math.nan, 1.5, 3.0],
    "frequency_penalty": [math.inf, 1.0, -3.0],
    "max_new_tokens": [-1, 2**63 - 1, 2**64 - 1, 10**6, -(2**63)],
    "min_new_tokens": [-1, 2, 5, 2**63 - 1],
    "sampling_seed": [0, -1, 2**63 - 1, 2**64 - 1, -(2**63)],
    "stop_token_ids": [[-1], [VOCAB_SIZE], [2**64 - 1], [0, 2]],
    "stop": [[""], ["a"]],
    "logit_bias": [{"-1": 1.0}, {str(VOCAB_SIZE): 1.0}, {"0": math.nan}, {"٣": 1.0}, {"1": math.inf}],
    "n": [0, 2, 2**63 - 1],
    "ignore_eos": [True],
    "regex": ["a+"],
}
IDS_EDGES = [[], [-1], [VOCAB_SIZE], [2**63 - 1], [2**64 - 1], [-(2**63)], [0] * 9000]
LOGPROB_EDGES = [
    {"start_len": 0, "top_k": 2}, {"top_k": -1}, {"top_k": VOCAB_SIZE + 1}, {"token_ids": [-5]},
    {"start_len": 2**63 - 1}, {"start_len": -(2**63)}, {"token_ids": [VOCAB_SIZE]},
]  # fmt: skip
# one wrong type (or a missing field) makes the message undecodable
TYPE_BREAKS: list[tuple[str, Any]] = [
    ("input_ids", [1.5]), ("input_ids", ["1"]), ("input_ids", None), ("input_ids", [[1, 2]]),
    ("rid", None), ("rid", 5), ("rid", b"x"), ("out_subject", 5), ("sampling", None), ("sampling", 5),
    ("sampling", {"temperature": "hot"}), ("sampling", {"max_new_tokens": "4"}), ("logprob", "x"),
    ("created", "now"), ("input_ids", ...), ("rid", ...), ("sampling", ...), ("out_subject", ...),
]  # fmt: skip


def wild_request(rng: random.Random, rid: str, inbox: str) -> dict[str, Any]:
    """A GenerateReq as a dict: a short prompt that generates a few tokens, with some fields at the
    edges; one in ten answers somewhere else than our inbox, one in five has a field of the wrong type."""
    sampling: dict[str, Any] = {"max_new_tokens": rng.randint(0, 4)}
    for key in rng.sample(sorted(SAMPLING_EDGES), rng.randint(0, 3)):
        sampling[key] = rng.choice(SAMPLING_EDGES[key])
    ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 8))]
    msg: dict[str, Any] = {"rid": rid, "input_ids": ids, "sampling": sampling, "out_subject": inbox}
    if rng.random() < 0.15:
        msg["input_ids"] = rng.choice(IDS_EDGES)
    if rng.random() < 0.15:
        msg["logprob"] = rng.choice(LOGPROB_EDGES)
    if rng.random() < 0.05:
        msg["created"] = rng.choice([math.nan, -1.0, 2**64 - 1])
    if rng.random() < 0.1:
        msg["out_subject"] = rng.choice(BAD_SUBJECTS)
    if rng.random() < 0.2:
        key, value = rng.choice(TYPE_BREAKS)
        if value is ...:
            del msg[key]
        elif key == "sampling" and isinstance(value, dict):
            msg[key] = {**sampling, **value}
        else:
            msg[key] = value
    return msg


def wants_answer(data: bytes, inbox: str) -> str | None:
    """The rid of a message that the scheduler must answer on our inbox: it decodes, and the rid is
    ours. Every such request ends with a finished output, whether it ran or was refused."""
    try:
        msg = Decoder(GenerateReq)(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return msg.rid if msg.out_subject == inbox and msg.rid.startswith("fuzz-") else None


# besides random bytes: messages that decode but make no sense where they arrive
NOISE = [b"[]", b'"x"', b"{}", b"null", b'{"service": 5}', b'{"service": "gateway", "out_subject": 5}'] + [
    msgspec.msgpack.encode(m)
    for m in [
        {"rids": "x"}, {"rids": ["nobody"], "restart": True}, {"rids": ["nobody"], "finish": {"type": 5}},
        {"outs": [{"rid": 5}]},
        {"outs": [{"rid": "nobody", "text": "x", "output_ids": [1], "finish": {"type": "stop"}}]},
        {"rids": ["nobody"], "token_ids": [[1]], "offsets": [0], "finish_reasons": [None]},
        {"new_reqs": [{"rid": "nobody", "out_subject": ">", "attempt": -1}], "rids": ["nobody"],
         "token_ids": [[2**63 - 1]], "cached_tokens": [0], "offsets": [5],
         "finish_reasons": [{"type": "stop"}]},
    ]
]  # fmt: skip


def noise(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randint(0, 64)) if rng.random() < 0.7 else rng.choice(NOISE)


async def gateway_out_subject(nc) -> str | None:
    """Where the gateway takes its output, from its heartbeat (None if none comes within 5 s)."""
    found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_beat(m) -> None:
        try:
            beat = json.loads(m.data)
            subject = beat["out_subject"] if beat["service"] == "gateway" else None
        except (ValueError, KeyError, TypeError):  # another fuzz's noise
            return
        if isinstance(subject, str) and not found.done():
            found.set_result(subject)

    sub = await nc.subscribe("sglbus.ctl.heartbeat", cb=on_beat)
    try:
        return await asyncio.wait_for(found, 5.0)
    except TimeoutError:
        return None
    finally:
        await sub.unsubscribe()


async def fuzz_bus(url: str, token: str | None, seed: int) -> tuple[dict[str, bytes], set[str], list[str]]:
    """Publishes the fuzz; returns the messages that must be answered (by rid), the rids that were
    answered, and problems with the answers."""
    rng = random.Random(seed)
    nc = await nats.connect(url, **({"token": token} if token else {}))
    inbox = nc.new_inbox()
    finished: set[str] = set()
    problems: list[str] = []

    async def on_out(m) -> None:
        try:
            outs = msgspec.msgpack.decode(m.data, type=BatchTextOut).outs
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            problems.append(f"output that does not decode as BatchTextOut: {e}: {m.data[:200]!r}")
            return
        for out in outs:
            if out.finished:
                finished.add(out.rid)
                if out.work_token:  # acknowledge it, as the gateway does
                    await nc.publish(out.work_token, b"+ACK")

    sub = await nc.subscribe(inbox, cb=on_out)
    # every subject a service listens on; the gateway's own output subject is in its heartbeat
    noise_subjects = ["sglbus.abort", "sglbus.detok.0", "sglbus.ctl.heartbeat"]
    noise_subjects += [s for s in [await gateway_out_subject(nc)] if s]
    expected: dict[str, bytes] = {}
    try:
        for i in range(N_BUS_REQUESTS):
            if rng.random() < 0.15:
                data = rng.randbytes(rng.randint(0, 64))
            else:
                data = msgspec.msgpack.encode(wild_request(rng, f"fuzz-{seed}-{i}", inbox))
            rid = wants_answer(data, inbox)
            if rid is not None:
                expected[rid] = data
            await nc.publish("sglbus.req", data)
            if expected and rng.random() < 0.05:  # an abort, which may overtake its request: no answer due
                victim = rng.choice(sorted(expected))
                del expected[victim]
                await nc.publish("sglbus.abort", msgspec.msgpack.encode({"rids": [victim]}))
            if rng.random() < 0.25:
                await nc.publish(rng.choice(noise_subjects), noise(rng))
        await nc.flush()
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while set(expected) - finished and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)  # what else arrives on the inbox
    finally:
        await sub.unsubscribe()
        await nc.close()
    return expected, finished, problems


def test_bus_fuzz_never_hangs_nor_breaks_the_server(server):
    client = httpx.Client(base_url=server.url, timeout=ANSWER_TIMEOUT_S)
    seed = 20261201
    try:
        before = reference_output(server, client)
        with new_tracebacks(server) as tracebacks:
            token = getattr(server, "nats_token", None)
            expected, finished, problems = asyncio.run(fuzz_bus(server.nats_url, token, seed))
            unanswered = sorted(set(expected) - finished, key=lambda r: int(r.rsplit("-", 1)[1]))
            assert not unanswered, (
                f"{len(unanswered)} of {len(expected)} decodable requests got no finished output within "
                f"{ANSWER_TIMEOUT_S} s (seed {seed}); first: "
                + "; ".join(f"{r}: {msgspec.msgpack.decode(expected[r])!r}" for r in unanswered[:5])
                + f"\n{server.tails()}"
            )
            assert not problems, problems[:5]
        assert not tracebacks, "\n".join(tracebacks)
        assert_healthy_after(server, client, before)
    finally:
        client.close()
