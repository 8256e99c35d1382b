"""plan_cascade: which decodes share a cached prefix, read from the radix tree's lock refs."""

from __future__ import annotations

import torch

from services.scheduler.cascade import CASCADE_MIN_GROUP, CASCADE_MIN_PREFIX, plan_cascade
from services.scheduler.radix_cache import RadixCache
from services.scheduler.request import Req
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams

CPU = torch.device("cpu")


def running(tree: RadixCache, prompt: list[int], row: int) -> Req:
    """A request whose prompt is cached and locked, as after its prefill."""
    r = Req(GenerateReq(rid=f"r{row}", input_ids=prompt, sampling=SamplingParams(), out_subject="x"), (2,))
    tree.insert(prompt, torch.arange(len(prompt)) + 1000 * (row + 1))
    r.last_node, r.row = tree.match_prefix(prompt).last_node, row
    tree.inc_lock_ref(r.last_node)
    return r


def test_groups_by_the_deepest_node_enough_requests_share():
    tree = RadixCache(free_slots=lambda _: None)
    system = list(range(CASCADE_MIN_PREFIX + 44))
    group = [running(tree, system + [5000 + i, 1], i) for i in range(CASCADE_MIN_GROUP + 2)]
    loners = [running(tree, [9000 + i] * 300, 50 + i) for i in range(2)]
    short = [running(tree, [7] * 10 + [8000 + i], 60 + i) for i in range(CASCADE_MIN_GROUP)]
    decodes = [loners[0], *group, loners[1], *short]
    plan = plan_cascade(decodes, 4, CPU)
    assert plan is not None
    starts = plan.kv_starts.tolist()
    assert starts == [0] + [len(system)] * len(group) + [0] + [0] * len(
        short
    )  # the short prefix is too short
    members = plan.members.tolist()
    assert members == list(range(1, 1 + len(group)))
    assert plan.tile_count.tolist() == [4, 4, 2] and plan.tile_first.tolist() == [0, 4, 8]
    assert plan.tile_len.tolist() == [len(system)] * 3
    assert plan.tile_row.tolist() == [decodes[members[i]].row for i in (0, 4, 8)]


def test_no_plan_without_a_large_enough_group():
    tree = RadixCache(free_slots=lambda _: None)
    system = list(range(CASCADE_MIN_PREFIX + 1))
    few = [running(tree, system + [5000 + i], i) for i in range(CASCADE_MIN_GROUP - 1)]
    assert plan_cascade(few, 4, CPU) is None
    assert plan_cascade(few[:2], 4, CPU) is None
