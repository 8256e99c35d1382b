"""What a scheduler knows about its own deaths, kept in one small JSON file per worker and bus
(`<SGLBUS_CACHE_DIR or ~/.cache/sglbus>/crashes/<subject prefix>.<worker id>.<crc32 of the NATS
URL>.json`) so that the next run of the process reads it.

A request that follows a crash runs alone for a while (quarantine.py). Before each step in which it
runs alone the file names it (`alone`) and every other request held here (`bystanders`); after the step
the mark is cleared. A process that dies with the mark set died in that request's step: the next run
charges it one crash and knows the bystanders were not in the step. The work queue's delivery count
cannot tell that: it also counts give-backs, and deliveries that were merely in a crashed batch.

Per request it keeps `crashes` (deaths in its steps alone) and `passes` (times it ran its first steps
alone without harm and then joined the batch); `innocent` holds requests whose next delivery is known
to follow no fault of theirs (given back on purpose, held at a clean stop, bystanders of a charged death).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import orjson

from shared.model_files import cache_root

if TYPE_CHECKING:
    from shared.config import EngineConfig

log = logging.getLogger(__name__)

# entries older than this are forgotten: JetStream drops an undelivered request after an hour
KEEP_S = 3600.0
MAX_INNOCENT = 100_000  # the set of innocent rids stays bounded whatever arrives


class CrashRecord:
    """`path` None: kept in memory only (in-process, where nothing dies alone; or where the file cannot be
    written: `durable` turns False and the scheduler falls back to counting deliveries)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.requests: dict[str, list[float]] = {}  # rid -> [crashes, passes, last change (wall clock)]
        self.innocent: dict[str, float] = {}  # rid -> when it was known innocent
        self.charged: str | None = None  # the request the last run's death was charged to (by load)

    @classmethod
    def for_worker(cls, cfg: EngineConfig, bus: str = "") -> CrashRecord:
        """This worker's record, read from its file (a death in a step alone is charged now). `bus`:
        the NATS it serves (two deployments on one machine, test servers say, keep records apart)."""
        name = f"{cfg.subject_prefix}.{cfg.worker_id}.{zlib.crc32(bus.encode()):08x}.json"
        record = cls(os.path.join(cache_root(), "crashes", name))
        record.load()
        return record

    @property
    def durable(self) -> bool:
        return self.path is not None

    def crashes(self, rid: str) -> int:
        return int(self.requests.get(rid, (0, 0, 0))[0])

    def passes(self, rid: str) -> int:
        return int(self.requests.get(rid, (0, 0, 0))[1])

    def take_innocent(self, rids: Iterable[str]) -> bool:
        """Whether any of these rids is known innocent (each is forgotten: it counts once)."""
        found = [self.innocent.pop(rid, None) for rid in rids]
        return any(t is not None for t in found)

    def add_innocent(self, rids: Iterable[str], save: bool = False) -> None:
        now = time.time()
        for rid in rids:
            self.innocent[rid] = now
        while len(self.innocent) > MAX_INNOCENT:
            del self.innocent[next(iter(self.innocent))]
        if save:
            self._save()

    def charge(self, rid: str) -> int:
        """One more death in `rid`'s step alone; returns its deaths so far."""
        entry = self._entry(rid)
        entry[0] += 1
        self._save()
        return int(entry[0])

    def passed(self, rid: str) -> None:
        """`rid` ran its first steps alone without harm and joins the batch."""
        self._entry(rid)[1] += 1
        self._save()

    def mark(self, rid: str, bystanders: list[str]) -> None:
        """Before a step in which `rid` runs alone: if the process dies now, the death is its own."""
        self._save(rid, bystanders)

    def unmark(self) -> None:
        self._save()

    def load(self) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                data = orjson.loads(f.read())
            alone, bystanders = data.get("alone"), data.get("bystanders") or []
            self.requests = {str(k): [float(x) for x in v[:3]] for k, v in data.get("requests", {}).items()}
            self.innocent = {str(k): float(v) for k, v in data.get("innocent", {}).items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as e:  # unreadable: start afresh
            log.warning("crash record %s unreadable (%s); starting a new one", self.path, e)
            alone, bystanders = None, []
        if isinstance(alone, str):
            self.charged = alone
            self.add_innocent(str(r) for r in bystanders)
            n = self.charge(alone)  # saves, without the mark
            log.error("%s was running alone when this scheduler died: its crash %d", alone, n)
        else:
            self._save()  # pruned

    def _entry(self, rid: str) -> list[float]:
        entry = self.requests.setdefault(rid, [0, 0, 0.0])
        entry[2] = time.time()
        return entry

    def _save(self, alone: str | None = None, bystanders: list[str] | None = None) -> None:
        if self.path is None:
            return
        old = time.time() - KEEP_S
        self.requests = {k: v for k, v in self.requests.items() if v[2] >= old}
        self.innocent = {k: t for k, t in self.innocent.items() if t >= old}
        data = {"alone": alone, "bystanders": bystanders or [], "requests": self.requests,
                "innocent": self.innocent}  # fmt: skip
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(orjson.dumps(data))
            os.replace(tmp, self.path)  # whole or not at all, even if the process dies here
        except OSError as e:
            log.error("cannot write the crash record %s (%s): counting deliveries instead", self.path, e)
            self.path = None
