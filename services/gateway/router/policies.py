"""Router policies by name (`--router-policy`). Each picks one of the candidate workers for a request;
the router has left out the workers past their admission bound (unless all are) and scored the rest.

- `cache_aware`: the fewest prefill tokens to wait for: the tokens of the prompt the worker would
  compute (its length less the leading blocks the worker holds) plus the prefill tokens queued there,
  plus `balance_weight` tokens per request it runs or queues. Affinity holds while the time it saves
  exceeds the imbalance it adds, and no longer (unlike a fixed `balance_*_threshold` that drops
  affinity altogether).
- `least_load`: the same without the cache: queued prefill tokens plus the request term.
- `round_robin`, `random`: for comparison.
- `shared` (not here): no worker is chosen; any scheduler takes the request off the shared lane of
  the work queue (the design before the router).

Ties (a new prefix on idle workers) go to the worker whose cache holds the fewest blocks, as SGLang's
router sends a miss to its smallest tree (there only when load is balanced, here only on equal cost),
then to the one that rendezvous-hashes highest with the prompt's first block: gateways that see the
same index and loads send a new prefix to the same worker."""

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


def rendezvous(key: int, worker: str) -> int:
    return hash((key, zlib.crc32(worker.encode())))


def _lowest(cands: list[Candidate], key: int, cost: Callable[[Candidate], float]) -> Candidate:
    return min(cands, key=lambda c: (cost(c), c.cached, -rendezvous(key, c.worker)))


def cache_aware(balance_weight: float) -> Policy:
    def choose(cands: list[Candidate], key: int) -> Candidate:
        return _lowest(cands, key, lambda c: c.new_tokens + c.queue_tokens + balance_weight * c.requests)

    return choose


def least_load(balance_weight: float) -> Policy:
    def choose(cands: list[Candidate], key: int) -> Candidate:
        return _lowest(cands, key, lambda c: c.queue_tokens + balance_weight * c.requests)

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
