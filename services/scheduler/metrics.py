"""What a scheduler reports for the gateway's `/metrics` (SGLang's scheduler metrics): built on the
scheduler thread, which owns the state it reads, and carried on the scheduler's heartbeat (about once
a second). `latest` is replaced whole, never changed in place, so the event loop reads a consistent
snapshot without a lock."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

WINDOW_S = 1.0  # gen_throughput and cache_hit_rate cover at least this long
MIN_INTERVAL_S = 0.25  # while busy, a snapshot is built at most this often


class SchedulerMetrics:
    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}
        self._built = 0.0
        self._window: tuple[float, int, int, int] | None = None  # (time, generated, prompt, cached)
        self._throughput = 0.0
        self._hit_rate = 0.0

    def refresh(self, sched: Scheduler, force: bool = False) -> None:
        """(scheduler thread) A new snapshot, unless one was built less than MIN_INTERVAL_S ago."""
        now = time.monotonic()
        if not force and now - self._built < MIN_INTERVAL_S:
            return
        self._built = now
        stats = sched.stats
        gen, prompt, cached = stats["generated_tokens"], stats["prompt_tokens"], stats["cached_tokens"]
        if self._window is None:
            self._window = (now, gen, prompt, cached)
        elif now - self._window[0] >= WINDOW_S:
            t0, gen0, prompt0, cached0 = self._window
            self._throughput = (gen - gen0) / (now - t0)
            if prompt > prompt0:  # SGLang's gauge is the hit rate of recent admissions; kept when none
                self._hit_rate = (cached - cached0) / (prompt - prompt0)
            self._window = (now, gen, prompt, cached)
        size = sched.kv.size
        used = sched.used_tokens()
        evictable = sched.tree.evictable_size()
        self.latest = {
            "num_running_reqs": len(sched.running),
            "num_queue_reqs": len(sched.waiting),
            "num_used_tokens": used,
            "token_usage": used / size if size else 0.0,
            "kv_used_tokens": used,
            "kv_available_tokens": size - used - evictable,
            "kv_evictable_tokens": evictable,
            "max_total_num_tokens": size,
            "cache_hit_rate": self._hit_rate,
            "gen_throughput": self._throughput,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "generated_tokens": gen,
            "retractions": stats["retractions"],
            "grammar_compilation_time": sched.grammars.compile_times.snapshot(),
        }
