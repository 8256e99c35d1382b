"""Router policies by name (`--router-policy`). Each picks one of the candidate workers for a request;
the router has left out the workers past their admission bound (unless all are) and scored the rest.

- `cache_aware`: affinity first, load when it outweighs affinity. The worker holding most of the
  prompt (whole blocks, shared/kv_blocks.py) is chosen unless another one is cheaper by more than
  NEAR_REQUESTS requests' weight, where a worker's cost is the prefill tokens to wait for: the tokens
  of the prompt it would compute (its length less the leading blocks it holds), plus a quarter of the
  prefill tokens queued there (QUEUE_WEIGHT), plus `balance_weight` tokens per request it runs or
  queues. Affinity holds while what it saves exceeds the imbalance it adds, and no longer (unlike a
  fixed `balance_*_threshold` that drops affinity altogether). Among several workers that hold as
  much (a new prefix: none holds any), or several near the cheapest, it spreads by consistent hashing
  with bounded loads: the rendezvous hash of the prompt's first block picks among those with no more
  than BOUND times the mean requests and cached blocks. Gateways that decide at the same moment (a
  burst through several of them, each seeing its own requests first) mostly agree, so a new prefix
  goes to one worker, not one per gateway; and new prefixes go to the emptier caches.
- `least_load`: the cost without the cache: queued prefill tokens plus the request term.
- `round_robin`, `random`: for comparison.
- `shared` (not here): no worker is chosen; any scheduler takes the request off the shared lane of
  the work queue (the design before the router)."""

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
    cached: int = 0  # blocks its prefix cache holds (the index's count: the same in every gateway)


Policy = Callable[[list[Candidate], int], Candidate]
# cache_aware: costs within this many requests' weight of the lowest are a tie
NEAR_REQUESTS = 2
# cache_aware: what a queued prefill token weighs against one this request would compute. Below 1: a
# request that leaves its prefix's worker because of a queue makes the system compute that prefix
# again (and a burst's queues are uneven for a moment only). A burst of 512 requests of 32 groups on 4
# workers (`python -m benchmarks.route_latency --simulate-burst`, seeds 0-4) put 9-13 groups on two
# workers with 1.0, 2-5 with 0.5, 2-4 with 0.25
QUEUE_WEIGHT = 0.25
# cache_aware spreads a new prefix over the workers with at most this much of the mean load and cache
BOUND = 1.25


def rendezvous(key: int, worker: str) -> int:
    return hash((key, zlib.crc32(worker.encode())))


def _spread(cands: list[Candidate], pool: list[Candidate], key: int) -> Candidate:
    """Consistent hashing with bounded loads: of `pool`, the rendezvous pick among the workers with no
    more than BOUND times the mean requests (over every candidate) and, of those, no more than BOUND
    times the mean cached blocks (new prefixes avoid the fullest caches). A bound that only outliers
    cross keeps gateways agreeing while their pictures lag each other a little; "the emptiest cache"
    would flip between workers near the mean."""
    n = len(cands)
    light = [c for c in pool if c.requests <= BOUND * sum(c.requests for c in cands) / n + 1]
    roomy = [c for c in light if c.cached <= BOUND * sum(c.cached for c in cands) / n]
    return max(roomy or light or pool, key=lambda c: rendezvous(key, c.worker))


def cache_aware(balance_weight: float) -> Policy:
    near = NEAR_REQUESTS * balance_weight

    def choose(cands: list[Candidate], key: int) -> Candidate:
        costs = {c.worker: c.new_tokens + QUEUE_WEIGHT * c.queue_tokens + balance_weight * c.requests
                 for c in cands}  # fmt: skip
        most = max(c.overlap for c in cands)
        pick = _spread(cands, [c for c in cands if c.overlap == most], key)
        cheapest = min(costs.values())
        if costs[pick.worker] <= cheapest + near:
            return pick
        return _spread(cands, [c for c in cands if costs[c.worker] <= cheapest + near], key)

    return choose


def least_load(balance_weight: float) -> Policy:
    def choose(cands: list[Candidate], key: int) -> Candidate:
        cost = lambda c: (c.queue_tokens + balance_weight * c.requests, -rendezvous(key, c.worker))
        return min(cands, key=cost)

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
