"""Many clients at once: continuous batching must not change any greedy output."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from it_helpers import generate, greedy

N_CLIENTS = 32
SUBJECTS = [
    "the ocean", "a red bicycle", "winter mornings", "the moon", "coffee", "an old library", "mountains",
    "a lost cat", "trains", "the desert", "music", "a thunderstorm", "gardening", "the city at night",
    "chess", "a lighthouse", "volcanoes", "bread", "the forest", "a robot", "friendship", "rivers",
    "snow", "the sun", "bees", "a castle", "the market", "clouds", "a violin", "islands", "rain", "stars",
]  # fmt: skip


def prompts() -> list[str]:
    return [f"Write one sentence about {s}:" for s in SUBJECTS[:N_CLIENTS]]


@pytest.mark.slow
def test_concurrent_clients_get_their_solo_results(srv, client):
    sp = greedy(8)
    solo = [generate(client, {"text": p, "sampling_params": sp}) for p in prompts()]

    async def one(http: httpx.AsyncClient, prompt: str) -> dict:
        r = await http.post("/generate", json={"text": prompt, "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()

    async def all_at_once() -> list[dict]:
        limits = httpx.Limits(max_connections=N_CLIENTS)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts()))

    before = srv.info()["stats"]["steps"]
    together = asyncio.run(all_at_once())
    steps = srv.info()["stats"]["steps"] - before
    for p, a, b in zip(prompts(), together, solo, strict=True):
        assert (a["text"], a["output_ids"]) == (b["text"], b["output_ids"]), p
        assert a["meta_info"]["prompt_tokens"] == b["meta_info"]["prompt_tokens"]
    # batched, not one after another: 32 x 8 tokens alone would take 256 steps
    assert steps < N_CLIENTS * 8 // 2, steps
