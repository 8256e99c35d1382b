"""A sampling profiler for benchmark runs: every few milliseconds it records where each Python thread
is (its innermost frames), then reports per thread the functions seen most often, by self time (the
innermost frame) and inclusive time (anywhere on the stack). A thread blocked in C (a CUDA sync, a
lock) shows the Python line that called it, which is what tells host-bound steps from device-bound
ones. The sampler needs the GIL to look, so it sees threads at their switch points: shares, not exact
times.

    with StackProfile() as prof:
        run_workload()
    print(prof.report())
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from types import FrameType

from benchmarks.sampler import PeriodicSampler


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_firstlineno} {code.co_qualname}"


class StackProfile(PeriodicSampler):
    def __init__(self, interval_s: float = 0.002) -> None:
        super().__init__(interval_s, "stack-profile")
        self.samples: collections.Counter[str] = collections.Counter()
        self.self_time: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def sample(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, str(ident))
            self.samples[name] += 1
            self.self_time[name][_where(frame)] += 1
            seen: set[str] = set()
            f: FrameType | None = frame
            while f is not None:
                w = _where(f)
                if w not in seen:
                    seen.add(w)
                    self.inclusive[name][w] += 1
                f = f.f_back
        time.sleep(0)

    def report(self, top: int = 20) -> str:
        lines = []
        for name, n in self.samples.most_common():
            lines.append(f"== thread {name}: {n} samples")
            for title, table in (("self", self.self_time[name]), ("inclusive", self.inclusive[name])):
                lines.append(f"  -- {title}")
                for where, k in table.most_common(top):
                    lines.append(f"  {100 * k / n:5.1f}%  {where}")
        return "\n".join(lines)
