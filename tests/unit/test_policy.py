"""Cache-aware ordering of waiting requests (no model)."""

from __future__ import annotations

import random
import time

import torch

from services.scheduler.policy import (
    IN_BATCH_CHECK_MAX_CACHED,
    IN_BATCH_HOLD_THRESHOLD,
    InBatchPrefixCheck,
    match_key,
    order_waiting,
)
from services.scheduler.radix_cache import RadixCache
from services.scheduler.request import Req
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams


def req(rid: str, ids: list[int], age: float = 0.0, max_new_tokens: int = 128) -> Req:
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    r = Req(GenerateReq(rid=rid, input_ids=ids, sampling=sp, out_subject="x"), (2,))
    r.arrival = time.monotonic() - age
    return r


def tree_with(*keys: list[int]) -> RadixCache:
    tree = RadixCache(free_slots=lambda _: None)
    for k in keys:
        tree.insert(k, torch.arange(len(k)))
    return tree


def test_lpm_orders_by_cached_prefix_and_fcfs_keeps_arrival():
    tree = tree_with(list(range(100)), [7] * 10)
    a = req("a", [500, 501, 502])  # no hit
    b = req("b", list(range(50)) + [900])  # 50 cached
    c = req("c", [7] * 5 + [1])  # 5 cached
    d = req("d", list(range(100)) + [1, 2])  # 100 cached
    waiting = [a, b, c, d]
    assert [r.rid for r in order_waiting(waiting, tree, "lpm", 30.0)] == ["d", "b", "c", "a"]
    assert [r.rid for r in order_waiting(waiting, tree, "fcfs", 30.0)] == ["a", "b", "c", "d"]


def test_starved_requests_go_first_whatever_the_policy():
    tree = tree_with(list(range(100)))
    old = req("old", [500, 501], age=60.0)
    hit = req("hit", list(range(100)) + [1])
    assert [r.rid for r in order_waiting([hit, old], tree, "lpm", 30.0)] == ["old", "hit"]
    assert [r.rid for r in order_waiting([hit, old], tree, "dfs-weight", 30.0)] == ["old", "hit"]


def test_lof_orders_by_tokens_left_to_generate_and_random_keeps_every_request():
    tree = tree_with(list(range(100)))
    a, b, c, d = (
        req(k, [i, 1], max_new_tokens=n)
        for i, (k, n) in enumerate([("a", 8), ("b", 64), ("c", 8), ("d", 32)])
    )
    b.output = [5] * 60  # retracted after 60 tokens: 4 left
    hit = req("hit", list(range(100)) + [1], max_new_tokens=16)  # a cached prefix counts for nothing
    order = [r.rid for r in order_waiting([a, b, c, d, hit], tree, "lof", 30.0)]
    assert order == ["d", "hit", "a", "c", "b"]  # ties (a, c) in arrival order
    waiting = [a, b, c, d, hit]
    shuffled = order_waiting(waiting, tree, "random", 30.0)
    assert sorted(r.rid for r in shuffled) == sorted(r.rid for r in waiting) and waiting == [a, b, c, d, hit]


def test_dfs_weight_visits_heavier_subtrees_first_and_keeps_siblings_together():
    tree = tree_with([1, 2, 3, 10, 11], [1, 2, 3, 20, 21], [5, 6, 7])
    reqs = [
        req("x1", [5, 6, 7, 9]),
        req("a1", [1, 2, 3, 10, 11, 4]),
        req("b1", [1, 2, 3, 20, 21, 4]),
        req("a2", [1, 2, 3, 10, 11, 5]),
        req("b2", [1, 2, 3, 20, 21, 5]),
        req("a3", [1, 2, 3, 10, 11, 6]),
    ]
    order = [r.rid for r in order_waiting(reqs, tree, "dfs-weight", 30.0)]
    # the [1,2,3] subtree weighs 5 and comes first; inside it the [10,11] branch (3) before [20,21] (2)
    assert order == ["a1", "a2", "a3", "b1", "b2", "x1"]


def test_in_batch_check_holds_back_requests_sharing_an_uncached_prefix():
    check = InBatchPrefixCheck()
    shared = list(range(1000, 1100))
    assert not check.hold_back(req("first", shared + [1]), cached_len=0)
    assert check.hold_back(req("second", shared + [2]), cached_len=0)
    assert not check.hold_back(req("other", list(range(5000, 5100))), cached_len=0)
    # a request that already hits the cache is not held back
    assert not check.hold_back(req("cached", shared + [3]), cached_len=100)


def test_in_batch_check_holds_back_past_the_threshold_only():
    base = list(range(1000, 1000 + IN_BATCH_HOLD_THRESHOLD))
    check = InBatchPrefixCheck()
    assert not check.hold_back(req("first", base + [7, 8, 9]), cached_len=0)
    # sharing exactly the threshold is not enough; one token more is
    assert not check.hold_back(req("same-threshold", base + [6, 8, 9]), cached_len=0)
    assert check.hold_back(req("one-more", base + [7, 5, 9]), cached_len=0)
    # a key no longer than the threshold neither covers nor is covered
    short = InBatchPrefixCheck()
    assert not short.hold_back(req("short", base[:-1] + [1]), cached_len=0)
    assert not short.hold_back(req("long", base[:-1] + [1, 2, 3]), cached_len=0)


def test_in_batch_check_agrees_with_a_radix_tree_of_the_admitted_keys():
    """The check keeps only each key's first tokens; a radix tree of the whole keys is the reference:
    held back exactly when the longest match with an admitted key passes the threshold."""
    rng = random.Random(0)
    for _ in range(200):
        check, tree = InBatchPrefixCheck(), RadixCache(free_slots=lambda _: None)
        stem = [rng.randrange(50) for _ in range(60)]
        for i in range(12):
            cut = rng.randrange(0, 60)
            ids = stem[:cut] + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
            r = req(f"r{i}", ids)
            cached = rng.choice([0, 0, 0, IN_BATCH_CHECK_MAX_CACHED + 1])
            key = match_key(r)  # what the tree-based check matched
            expected = (
                cached <= IN_BATCH_CHECK_MAX_CACHED
                and len(tree.match_prefix(key).indices) > IN_BATCH_HOLD_THRESHOLD
            )
            assert check.hold_back(r, cached) == expected
            if not expected and cached <= IN_BATCH_CHECK_MAX_CACHED and key:
                tree.insert(key, torch.zeros(len(key), dtype=torch.int64))
