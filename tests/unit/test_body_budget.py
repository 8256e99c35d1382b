"""Request bodies as they arrive (`http_util.read_json`): the bytes buffered across connections stay
within the gateway's budget (a 503 past it, the room back once a body is read or refused), and a
client that goes away mid-body is a quiet 499, not an error in the server's log."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from services.gateway.http_util import BodiesFull, BodyBudget, ClientGone, read_json


def request(parts: list[bytes], rest: asyncio.Event | None = None, disconnect: bool = False) -> Request:
    """A body of `parts`; the last one only once `rest` is set (a body still arriving)."""
    messages = [{"type": "http.request", "body": p, "more_body": True} for p in parts]
    end = (
        {"type": "http.disconnect"}
        if disconnect
        else {"type": "http.request", "body": b"", "more_body": False}
    )
    messages.append(end)

    async def receive():
        if len(messages) == 1 and rest is not None:
            await rest.wait()
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def test_bodies_share_a_budget_and_give_it_back() -> None:
    async def run():
        budget = BodyBudget(100)
        assert await read_json(request([b"[" + b" " * 90, b"]"]), 1000, budget=budget) == []
        assert budget.held == 0  # read: its room is back
        rest = asyncio.Event()
        slow = asyncio.ensure_future(read_json(request([b"[", b" " * 60, b"]"], rest), 1000, budget=budget))
        while budget.held < 62:  # it holds 62 bytes and waits for the rest
            await asyncio.sleep(0)
        with pytest.raises(BodiesFull, match="max_buffered_bytes, 100"):
            await read_json(request([b"[" + b" " * 60, b"]"]), 1000, budget=budget)
        assert budget.held == 62  # the refused body gave back what it took
        rest.set()
        assert await slow == [] and budget.held == 0
        assert BodiesFull.status == 503

    asyncio.run(run())


def test_a_client_gone_mid_body_is_a_499() -> None:
    budget = BodyBudget(1 << 20)
    with pytest.raises(ClientGone, match="went away after 3 bytes") as e:
        asyncio.run(read_json(request([b"[1,"], disconnect=True), 1000, budget=budget))
    assert e.value.status == 499 and budget.held == 0
