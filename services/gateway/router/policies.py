"""Router policies by name (`--router-policy`). Each picks one of the candidate workers for a request;
the router has left out the workers past their admission bound (unless all are) and scored the rest.

- `cache_aware`: the fewest prefill tokens to wait for: the tokens of the prompt the worker would
  compute (its length less the leading blocks the worker holds) plus a quarter of the prefill tokens
  queued there (QUEUE_WEIGHT), plus `balance_weight` tokens per request it runs or queues. Affinity
  holds while what it saves exceeds the imbalance it adds, and no longer (unlike a fixed
  `balance_*_threshold` that drops affinity altogether).
- `least_load`: the same without the cache: queued prefill tokens plus the request term.
- `round_robin`, `random`: for comparison.
- `shared` (not here): no worker is chosen; any scheduler takes the request off the shared lane of
  the work queue (the design before the router).

Ties (for cache_aware: costs within NEAR_REQUESTS requests' weight of the lowest) go to the worker
holding most of the prompt, then to the one whose cache holds the fewest blocks (as SGLang's router
sends a miss to its smallest tree: there only when load is balanced, here only on a near-equal cost),
then to the one that rendezvous-hashes highest with the prompt's first block: gateways that see the
same index and nearly the same loads send a new prefix to the same worker."""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Candidate:
    worker: str
    overlap: int  # leading prompt tokens the worker holds (whole blocks)
    new_tokens: int  # prompt tokens it would compute
    queue_tokens: int  # prefill tokens queued there (its last report plus what was routed since)
    requests: int  # requests it runs or queues (likewise)
    cached: int = 0  # blocks its prefix cache holds (the index's count)


Policy = Callable[[list[Candidate], int], Candidate]
# cache_aware: costs within this many requests' weight of the lowest are a tie
NEAR_REQUESTS = 2
# cache_aware: what a queued prefill token weighs against one this request would compute. Below 1: a
# request that leaves its prefix's worker because of a queue makes the system compute that prefix
# again (and a burst's queues are uneven for a moment only). A burst of 512 requests of 32 groups on 4
# workers (`python -m benchmarks.route_latency --simulate-burst`, seeds 0-4) put 7-13 groups on two
# workers with 1.0, 2-4 with 0.5, 0-2 with 0.25
QUEUE_WEIGHT = 0.25


def rendezvous(key: int, worker: str) -> int:
    return hash((key, zlib.crc32(worker.encode())))


def _lowest(cands: list[Candidate], key: int, cost: Callable[[Candidate], float], near: float) -> Candidate:
    """The cheapest candidate; among those within `near` of it, the one holding most of the prompt,
    then the emptiest cache, then the rendezvous hash's pick. (`near`: gateways deciding at the same
    moment see slightly different loads; a near tie settles alike in each of them.)"""
    costs = {c.worker: cost(c) for c in cands}
    bound = min(costs.values()) + near
    return min((c for c in cands if costs[c.worker] <= bound),
               key=lambda c: (-c.overlap, c.cached, -rendezvous(key, c.worker)))  # fmt: skip


def cache_aware(balance_weight: float) -> Policy:
    def choose(cands: list[Candidate], key: int) -> Candidate:
        cost = lambda c: c.new_tokens + QUEUE_WEIGHT * c.queue_tokens + balance_weight * c.requests
        return _lowest(cands, key, cost, NEAR_REQUESTS * balance_weight)

    return choose


def least_load(balance_weight: float) -> Policy:
    def choose(cands: list[Candidate], key: int) -> Candidate:
        return _lowest(cands, key, lambda c: c.queue_tokens + balance_weight * c.requests, 0.0)

    return choose


def round_robin(balance_weight: float) -> Policy:
    turn = itertools.count()

    def choose(cands: list[Candidate], key: int) -> Candidate:
        return sorted(cands, key=lambda c: c.worker)[next(turn) % len(cands)]

    return choose


def random_choice(balance_weight: float) -> Policy:
    rng = random.Random()

    def choose(cands: list[Candidate], key: int) -> Candidate:
        return rng.choice(cands)

    return choose


# name -> factory(balance_weight); `shared` is the router's own case (no worker chosen)
POLICIES: dict[str, Callable[[float], Policy]] = {
    "cache_aware": cache_aware,
    "round_robin": round_robin,
    "least_load": least_load,
    "random": random_choice,
}
ROUTER_POLICIES = (*POLICIES, "shared")


def make_policy(name: str, balance_weight: float) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, not {name!r}")
    return POLICIES[name](balance_weight)
