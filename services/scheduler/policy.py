"""Which waiting requests to admit first (SGLang paper §3, cache-aware scheduling).

- `lpm`: longest cached prefix first. Past `LPM_MAX_WAITING` waiting requests matching them all costs
  more than it saves, so it falls back to arrival order (as SGLang does).
- `dfs-weight`: each radix node weighs as many waiting requests as end below it; requests come out in
  DFS order, heavier subtrees first, which is the order that maximises hits (Theorem 3.1).
- `fcfs`: arrival order.
- `lof`: longest output first, by the tokens a request may still generate (`max_new_tokens` less its
  output: SGLang's `lof` sorts by max_new_tokens alone, which a retracted request would misstate),
  ties in waiting-list order: long requests start early and short ones fill the batch at the end, so
  fewer steps run nearly empty while the last long requests finish.
- `random`: a random order each step (as SGLang's).
Requests that waited longer than `max_wait` seconds go first whatever the policy, so a greedy
policy cannot starve them.

`InBatchPrefixCheck` holds back a request whose prompt shares a long uncached prefix with one admitted
earlier in the same step: that one computes the prefix, the held-back one hits it a step later. Under
overlap scheduling the previous step's check holds back too: its prefills are still in flight, not
yet in the cache.
"""

from __future__ import annotations

import random
import time

from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.radix_cache import RadixCache, TreeNode
from services.scheduler.request import Req

LPM_MAX_WAITING = 128
IN_BATCH_CHECK_MAX_CACHED = 32  # only requests with little cached prefix are checked
IN_BATCH_HOLD_THRESHOLD = 32  # shared uncached tokens that make a request wait for the other


def match_key(req: Req) -> list[int]:
    """The prefix that can come from the cache: all but the last token, which must be computed to
    produce logits, and nothing from the first position that still owes a prompt logprob."""
    return req.fill[: _key_len(req)]


def _key_len(req: Req) -> int:
    n = req.fill_len - 1
    return min(n, req.lp_pos) if req.lp_pos < req.lp_end else n


def order_waiting(waiting: list[Req], tree: PrefixCache, policy: str, max_wait: float) -> list[Req]:
    now = time.monotonic()
    starved = [r for r in waiting if now - r.arrival > max_wait]
    rest = [r for r in waiting if now - r.arrival <= max_wait] if starved else waiting
    if policy == "lof":
        ordered = sorted(rest, key=lambda r: -r.remaining_output)  # stable
    elif policy == "random":
        ordered = random.sample(rest, len(rest))
    elif policy == "fcfs" or not tree.shares or (policy == "lpm" and len(waiting) > LPM_MAX_WAITING):
        ordered = rest
    elif policy == "lpm":
        lengths = {id(r): len(tree.match_prefix(match_key(r)).indices) for r in rest}
        ordered = sorted(rest, key=lambda r: -lengths[id(r)])  # stable: ties keep arrival order
    elif policy == "dfs-weight":
        ordered = _dfs_weight(rest, tree)
    else:
        raise ValueError(f"unknown schedule policy {policy!r}")
    return starved + ordered


def _dfs_weight(reqs: list[Req], tree: RadixCache) -> list[Req]:
    at_node: dict[int, list[Req]] = {}
    nodes: dict[int, TreeNode] = {}
    for r in reqs:
        node = tree.match_prefix(match_key(r)).last_node
        at_node.setdefault(id(node), []).append(r)
        nodes[id(node)] = node
    weight: dict[int, int] = {}
    for key, rs in at_node.items():
        node: TreeNode | None = nodes[key]
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + len(rs)
            node = node.parent
    out: list[Req] = []
    stack = [tree.root]
    while stack:
        node = stack.pop()
        out.extend(at_node.get(id(node), []))
        children = [c for c in node.children.values() if id(c) in weight]
        children.sort(key=lambda c: weight[id(c)])  # lightest pushed first, so heaviest pops first
        stack.extend(children)
    return out


class InBatchPrefixCheck:
    """The first IN_BATCH_HOLD_THRESHOLD + 1 tokens of each key admitted in the step: another key
    shares more than the threshold with one of them exactly when its own first tokens are among them.
    (A radix tree gave the same answers, but each step's tree, a node and a tensor per admitted request,
    was left to the cycle collector.)"""

    def __init__(self) -> None:
        self._heads: set[tuple[int, ...]] = set()

    def hold_back(self, req: Req, cached_len: int) -> bool:
        """True: wait for a request admitted earlier in this step; else `req` is recorded as admitted."""
        if cached_len > IN_BATCH_CHECK_MAX_CACHED or (head := _key_head(req)) is None:
            return False
        if head in self._heads:
            return True
        self._heads.add(head)
        return False

    def covers(self, req: Req, cached_len: int) -> bool:
        """Whether a request admitted in this step computes a long uncached prefix of `req`."""
        if cached_len > IN_BATCH_CHECK_MAX_CACHED:
            return False
        head = _key_head(req)
        return head is not None and head in self._heads


def _key_head(req: Req) -> tuple[int, ...] | None:
    """match_key(req)'s first IN_BATCH_HOLD_THRESHOLD + 1 tokens; None if it is not that long."""
    n = IN_BATCH_HOLD_THRESHOLD + 1
    return tuple(req.fill[:n]) if _key_len(req) >= n else None
