"""Scheduling under pressure and across policies: same greedy output, no leaked KV."""

from __future__ import annotations

import time

import pytest

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "In 1969, the first humans",
    "A haiku about the sea:",
    "def add(a, b):",
    "The quick brown fox",
    "Water boils at",
    "My favourite book is",
]
# 8 prompts of 44 tokens in all and 12 new tokens each: 140 tokens, more than the tiny pool below holds
PARAMS = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(engine):
    return [o["output_ids"] for o in engine.generate(PROMPTS, PARAMS)]


def test_tiny_pool_retracts_and_still_completes_every_request(make_engine, reference):
    engine = make_engine(max_total_tokens=120, new_token_ratio=0.0)
    outs = engine.generate(PROMPTS, PARAMS)
    assert [o["output_ids"] for o in outs] == reference
    assert engine.get_stats()["retractions"] > 0


@pytest.mark.parametrize("options", [
    {"schedule_policy": "fcfs"}, {"schedule_policy": "dfs-weight"}, {"schedule_policy": "lof"},
    {"schedule_policy": "random"}, {"disable_radix_cache": True},
    {"max_running_requests": 2}, {"chunked_prefill_size": 3},
])  # fmt: skip
def test_policies_and_limits_do_not_change_output(make_engine, reference, options):
    engine = make_engine(**options)
    outs = engine.generate(PROMPTS, PARAMS)
    assert [o["output_ids"] for o in outs] == reference
    if options.get("disable_radix_cache"):
        again = engine.generate(PROMPTS, PARAMS)
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in again)


def test_shared_prefix_is_computed_once(make_engine):
    engine = make_engine()
    prefix = "You are a careful assistant. Answer the question with one word. " * 8
    questions = [f"{prefix}Question {i}: what colour is the sky?" for i in range(6)]
    outs = engine.generate(questions, {"temperature": 0, "max_new_tokens": 2})
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    prefix_len = len(engine.tokenizer.encode(prefix))
    # one request computes the shared prefix; the in-batch check makes the others wait and hit it
    assert cached[0] < prefix_len and all(c >= prefix_len - 1 for c in cached[1:])


def test_closing_a_stream_aborts_the_request_and_frees_its_kv(make_engine):
    engine = make_engine()
    stream = engine.generate(PROMPTS[0], {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
    next(stream), next(stream)
    stream.close()
    deadline = time.monotonic() + 10
    while engine.get_stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.get_stats()
    assert stats["running"] == 0 and stats["generated_tokens"] < 500
    engine.check_integrity()
