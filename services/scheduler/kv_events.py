"""What a scheduler tells the routers (services/gateway/router/): the blocks its radix cache stored and
evicted, batched per step, and its load, on `<prefix>.kv.<worker>` (`shared.messages.KvEvents`), with
a snapshot of every block it holds for a gateway that starts or sees a gap in `seq`.

A message goes out after each step that changed the cache or the load (a few dozen a second on a
busy GPU, each a few hundred bytes: routers see a worker's load as of its last step), and at least
every KEEPALIVE_S (a gateway that missed the last message sees the gap within a second)."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.scheduler.radix_cache import BlockLog, RadixCache
from shared.kv_blocks import BLOCK_TOKENS, block_hashes
from shared.messages import KvEvents, KvSnapshot, WorkerLoad

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

KEEPALIVE_S = 1.0
# blocks of prompts that arrived lately count as computed for the prompts after them (the first one
# computes them, the others hit them: the scheduler's in-batch prefix check), for this long
RECENT_S = 30.0
_RECENT_MAX = 1 << 20


class KvEventStream:
    def __init__(self, worker: str, sched: Scheduler) -> None:
        self.worker, self.instance = worker, uuid.uuid4().hex[:12]
        self.seq = 0
        self.log = BlockLog()
        if isinstance(sched.tree, RadixCache):  # --disable-radix-cache: nothing is ever held
            sched.tree.block_log = self.log
        self._sent_at = 0.0
        self._load: WorkerLoad | None = None
        self._recent: OrderedDict[int, float] = OrderedDict()  # block of a recent prompt -> when
        self.received = 0  # first deliveries taken off this worker's own lane (WorkerLoad.received)

    # -- the event loop: a request arrives -------------------------------------------------------
    def new_tokens(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens this worker will have to compute: all but its leading
        blocks that the cache holds or that a prompt which arrived lately brings (an estimate: the
        cache may evict them meanwhile)."""
        blocks = block_hashes(prompt)
        now, held, recent = time.monotonic(), self.log.held, self._recent
        hit = 0
        for h in blocks:
            if h not in held and h not in recent:
                break
            hit += 1
        for h in blocks:
            recent[h] = now
            recent.move_to_end(h)
        while recent and (len(recent) > _RECENT_MAX or next(iter(recent.values())) < now - RECENT_S):
            recent.popitem(last=False)
        return len(prompt) - hit * BLOCK_TOKENS

    # -- the scheduler thread --------------------------------------------------------------------
    def message(self, sched: Scheduler) -> KvEvents | None:
        """The next message, or None when nothing is worth sending yet."""
        now = time.monotonic()
        changed = bool(self.log.stored or self.log.removed or self.log.cleared)
        due = now - self._sent_at >= KEEPALIVE_S
        load = worker_load(sched, self.received)
        if not changed and not due and load == self._load:
            return None
        stored, removed, cleared = self.log.take()
        self.seq += 1
        self._sent_at, self._load = now, load
        return KvEvents(worker=self.worker, instance=self.instance, seq=self.seq, stored=stored,
                        removed=removed, cleared=cleared, load=load)  # fmt: skip

    def snapshot(self, sched: Scheduler) -> tuple[KvEvents | None, KvSnapshot]:
        """Every block held, as of a message that first carries what changed since the last one (to
        send before the snapshot's answer)."""
        pending = None
        if self.log.stored or self.log.removed or self.log.cleared:
            self._sent_at = 0.0
            pending = self.message(sched)
        blocks = sched.tree.all_blocks() if isinstance(sched.tree, RadixCache) else []
        snap = KvSnapshot(worker=self.worker, instance=self.instance, seq=self.seq, blocks=blocks,
                          load=worker_load(sched, self.received))  # fmt: skip
        return pending, snap


def worker_load(sched: Scheduler, received: int = 0) -> WorkerLoad:
    held = [r for group in sched.held.values() for r in group]
    return WorkerLoad(
        running=len(sched.running),
        waiting=len(sched.waiting) + len(held),
        waiting_tokens=sum(r.queued_tokens for r in sched.waiting),
        kv_used=sched.used_tokens(),
        kv_total=sched.kv.size,
        max_running=sched.max_running,
        max_queued=sched.cfg.max_queued_requests or 0,
        received=received,
    )
