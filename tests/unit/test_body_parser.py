"""Large bodies go through the parsing child process and come back as the in-place parse would give
them; the child's death, or a child that is stuck, costs no request."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import orjson
import pytest

from services.gateway.body_parser import BodyParser, parse

VOCAB = 1000
PAD = b" " * (1 << 20)  # JSON whitespace: any body becomes a large one


def _big(obj: object) -> bytes:
    return orjson.dumps(obj) + PAD


async def _both(body: bytes):
    bodies = BodyParser(VOCAB, child_bytes=1 << 20)
    try:
        return parse(body), await bodies.parse(body)
    finally:
        await bodies.stop()


@pytest.mark.parametrize(
    "obj",
    [
        {"input_ids": [[i % VOCAB for i in range(70_000)], [5, 6]], "sampling_params": {"max_new_tokens": 2}},
        {"input_ids": [1, 2, 3], "stream": True},
        {"text": ["a", "b"], "sampling_params": [{"temperature": 0}, {"temperature": 1}]},
        {"text": "x", "bad_field": 1},
        {"input_ids": [[1], []]},
    ],
)
def test_child_gives_the_in_place_result(obj):
    (stream, want), (got_stream, got) = asyncio.run(_both(_big(obj)))
    assert got_stream == stream
    if isinstance(want, ValueError):
        assert isinstance(got, ValueError) and str(got) == str(want)
        return
    for a, b in zip(want.prompts, got.prompts, strict=True):
        assert (a.text, a.input_ids, a.sampling, a.logprob) == (b.text, b.input_ids, b.sampling, b.logprob)
        assert type(b.input_ids) in (list, type(None))
    assert (want.is_batch, want.stream) == (got.is_batch, got.stream)


def test_child_refuses_ids_outside_the_vocabulary_and_bad_json():
    _, (_, got) = asyncio.run(_both(b'{"input_ids": [1, %d, 18446744073709551615]}' % VOCAB + PAD))
    assert isinstance(got, ValueError) and f"outside the vocabulary [0, {VOCAB})" in str(got)
    _, (_, got) = asyncio.run(_both(b"{not json" + PAD))
    assert isinstance(got, ValueError) and "invalid JSON" in str(got)


def test_a_dead_child_costs_no_request():
    async def run():
        bodies = BodyParser(VOCAB)
        await bodies.start()
        first = bodies._child
        assert first is not None
        first.kill()
        await first.wait()
        try:
            _, a = await bodies.parse(_big({"input_ids": [4, 5]}))  # on a thread, the child being dead
            _, b = await bodies.parse(_big({"input_ids": [6]}))  # a new child
            return a, b, bodies._child is not first and bodies._child is not None
        finally:
            await bodies.stop()

    a, b, restarted = asyncio.run(run())
    assert a.prompts[0].input_ids == [4, 5] and b.prompts[0].input_ids == [6] and restarted


def test_a_stuck_child_is_replaced_and_its_body_parses_on_a_thread(caplog):
    """A stopped child (SIGSTOP: swapped out, stuck) would hang the request: past the timeout it is
    killed, the body parses on a thread, and the next large body gets a new child."""

    async def run():
        bodies = BodyParser(VOCAB, timeout_s=0.5, timeout_s_per_mib=0.0)
        await bodies.start()
        stuck = bodies._child
        assert stuck is not None
        os.kill(stuck.pid, signal.SIGSTOP)
        try:
            _, a = await asyncio.wait_for(bodies.parse(_big({"input_ids": [4, 5]})), 60)
            bodies.timeout_s = 60.0  # the new child's interpreter start must not count against it
            _, b = await bodies.parse(_big({"input_ids": [6]}))
            return a, b, stuck.returncode, bodies._child is not stuck and bodies._child is not None
        finally:
            with contextlib.suppress(ProcessLookupError):
                stuck.kill()
            await bodies.stop()

    a, b, code, replaced = asyncio.run(run())
    assert a.prompts[0].input_ids == [4, 5] and b.prompts[0].input_ids == [6]
    assert code == -signal.SIGKILL and replaced
    assert "did not answer within 0.5 s" in caplog.text


def test_a_cancelled_parse_leaves_no_answer_for_the_next_body():
    """A caller that goes away while the child works: that child's late answer must not become the
    next body's."""

    async def run():
        bodies = BodyParser(VOCAB)
        await bodies.start()
        first = bodies._child
        assert first is not None
        os.kill(first.pid, signal.SIGSTOP)  # it holds the first body until the caller gave up
        try:
            task = asyncio.ensure_future(bodies.parse(_big({"input_ids": [1, 2, 3]})))
            await asyncio.sleep(0.2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(ProcessLookupError):
                os.kill(first.pid, signal.SIGCONT)
            _, b = await bodies.parse(_big({"input_ids": [7]}))
            return b, await first.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                first.kill()
            await bodies.stop()

    b, code = asyncio.run(run())
    assert b.prompts[0].input_ids == [7] and code == -signal.SIGKILL


@pytest.mark.parametrize("size", ["small", "large"])
def test_prompts_times_n_past_the_bound_is_refused_before_the_prompts_are_built(size: str) -> None:
    """250,000 prompts with n 128 (a 1 MiB body) is answered from the counts alone, in place and in
    the child, so the gateway never builds 250,000 prompts to refuse them."""
    obj = {"input_ids": [[1]] * 250_000, "sampling_params": {"n": 128}}
    body = orjson.dumps(obj) + (PAD if size == "large" else b"")

    async def run():
        bodies = BodyParser(VOCAB, max_states=4096, child_bytes=1 << 20)
        try:
            return await bodies.parse(body)
        finally:
            await bodies.stop()

    _, parsed = asyncio.run(run())
    assert isinstance(parsed, ValueError)
    assert "at most 4096 prompts x n" in str(parsed) and "250000 x 128 = 32000000" in str(parsed)
    _, fine = parse(orjson.dumps({"input_ids": [[1]] * 32, "sampling_params": {"n": 128}}), max_states=4096)
    assert not isinstance(fine, ValueError) and len(fine.prompts) == 32
