"""Which worker holds which prefix-cache blocks, built only from the workers' own KvEvents (and a
snapshot when a gateway starts or misses one), so every gateway replica sees the same picture.

Per worker the index follows one run (`instance`) and its message numbers (`seq`): the next number
applies; an older one is a duplicate; a jump, or a run first met past its first message, asks the
worker for a snapshot (`KvSnapshot`) and keeps its messages until the snapshot came, then applies
those past it. A gateway's own guesses (what it routed lately) live in the router, not here."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from shared.messages import KvEvents, KvSnapshot

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    instance: str
    seq: int = 0
    blocks: set[int] = field(default_factory=set)
    syncing: bool = False  # waiting for a snapshot: messages are kept, not applied
    kept: list[KvEvents] = field(default_factory=list)


class KvIndex:
    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}  # block hash -> the workers that hold it
        self._workers: dict[str, _Worker] = {}
        self.gaps = 0  # snapshots asked for (a missed message, a worker met late)

    def on_events(self, ev: KvEvents) -> bool:
        """Apply a worker's message; True when the index now needs that worker's snapshot."""
        w = self._workers.get(ev.worker)
        if w is None or w.instance != ev.instance:  # a new run of that worker (or one never seen)
            self._forget(ev.worker)
            w = self._workers[ev.worker] = _Worker(ev.instance)
            if ev.seq != 1:
                return self._sync(w, ev)
        if w.syncing:
            w.kept.append(ev)
            return False
        if ev.seq <= w.seq:
            return False
        if ev.seq != w.seq + 1:
            return self._sync(w, ev)
        self._apply(ev.worker, w, ev)
        return False

    def on_snapshot(self, snap: KvSnapshot) -> bool:
        """Take a worker's snapshot; True when it still needs one (the snapshot was of another run,
        or the messages kept meanwhile have a gap past it)."""
        w = self._workers.get(snap.worker)
        if w is None or w.instance != snap.instance or not w.syncing:
            return w is not None and w.syncing
        self._set_blocks(snap.worker, w, snap.blocks)
        w.seq, w.syncing = snap.seq, False
        kept, w.kept = sorted(w.kept, key=lambda e: e.seq), []
        for ev in kept:
            if ev.seq <= w.seq:
                continue
            if ev.seq != w.seq + 1:
                return self._sync(w, ev)
            self._apply(snap.worker, w, ev)
        return False

    def drop(self, worker: str) -> None:
        """A worker that left (or died): its blocks no longer count; a later message of it asks for a
        snapshot (or starts afresh when it is a new run's first)."""
        self._forget(worker)

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def syncing(self, worker: str) -> bool:
        """Whether the worker's snapshot is awaited (its blocks here are not its cache's yet)."""
        w = self._workers.get(worker)
        return w is not None and w.syncing

    def size(self, worker: str) -> int:
        w = self._workers.get(worker)
        return 0 if w is None else len(w.blocks)

    def overlaps(self, blocks: list[int], workers: Collection[str],
                 extra: dict[int, dict[str, int]] | None = None) -> dict[str, int]:  # fmt: skip
        """For each of `workers`, how many leading blocks of `blocks` it holds (or, per `extra`, is
        about to: block -> {worker: count})."""
        out = dict.fromkeys(workers, 0)
        alive = set(workers)
        for i, h in enumerate(blocks):
            have = alive & self.holders.get(h, set())
            if extra is not None and h in extra:
                have |= alive & extra[h].keys()
            for w in alive - have:
                out[w] = i
            alive = have
            if not alive:
                return out
        for w in alive:
            out[w] = len(blocks)
        return out

    # -- internals --------------------------------------------------------------------------------
    def _sync(self, w: _Worker, ev: KvEvents) -> bool:
        w.syncing = True
        w.kept.append(ev)
        self.gaps += 1
        return True

    def _apply(self, worker: str, w: _Worker, ev: KvEvents) -> None:
        if ev.cleared:
            self._set_blocks(worker, w, ())
        for h in ev.stored:
            if h not in w.blocks:
                w.blocks.add(h)
                self.holders.setdefault(h, set()).add(worker)
        self._remove(worker, w, ev.removed)
        w.seq = ev.seq

    def _set_blocks(self, worker: str, w: _Worker, blocks: Iterable[int]) -> None:
        self._remove(worker, w, list(w.blocks))
        for h in blocks:
            w.blocks.add(h)
            self.holders.setdefault(h, set()).add(worker)

    def _remove(self, worker: str, w: _Worker, blocks: Iterable[int]) -> None:
        for h in blocks:
            if h in w.blocks:
                w.blocks.discard(h)
                holders = self.holders[h]
                holders.discard(worker)
                if not holders:
                    del self.holders[h]

    def _forget(self, worker: str) -> None:
        w = self._workers.pop(worker, None)
        if w is not None:
            self._remove(worker, w, list(w.blocks))
