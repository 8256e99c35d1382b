"""What the scheduler reports and checks about its KV pool and prefix cache, between steps: the slots
in use, the KV invariant, and flushing the cache when idle. A mixin of `Scheduler`, beside
`RequestIntake` (intake.py), so scheduler.py keeps the step loop."""

from __future__ import annotations

from typing import Any

from services.scheduler.memory import KVPool
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Req


class PoolState:
    kv: KVPool
    tree: PrefixCache
    running: list[Req]
    stats: dict[str, Any]
    _promised: int  # KV slots promised to the step being built (Scheduler._extend)
    has_work: bool  # Scheduler's property: requests waiting, running or in flight

    def flush_cache(self) -> bool:
        if self.has_work:
            return False
        self.tree.reset()
        self.stats["cache_flushes"] += 1
        return True

    def used_tokens(self) -> int:
        """KV slots held by running requests or locked in the cache (what cannot be evicted)."""
        return self.kv.size - (self.kv.free_count - self._promised) - self.tree.evictable_size()

    def check_integrity(self) -> None:
        """The KV invariant (memory.py); raises AssertionError on a leak."""
        in_use = sum(r.num_computed - r.num_cached for r in self.running)
        self.kv.check(self.tree.total_size(), in_use, None if self.running else self.tree.all_slots())
