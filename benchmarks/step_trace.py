"""Where the GPU's time went in a run, step by step (CUDA only): the scheduler's StepTimer trace,
summed by step kind and batch size. `idle` is the GPU's wait before a step (host work that did not
hide behind the device's work).

    python -m benchmarks.offline --model-path <folder> --load-format dummy ... --step-trace
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict

_BOUNDS = (1, 64, 256, 512, 1024, 2048, 4096)


def _bucket(n: int) -> int:
    """The index of n's range of batch sizes in _BOUNDS."""
    return sum(n >= b for b in _BOUNDS[1:])


def _label(i: int) -> str:
    return f"{_BOUNDS[i]}-{_BOUNDS[i + 1] - 1}" if i + 1 < len(_BOUNDS) else f">={_BOUNDS[-1]}"


def summarize(trace: list[tuple[str, int, int, float, float]]) -> str:
    """Rows: kind, requests per step (bucket), steps, mean requests, mean tokens, device s, ms/step,
    idle s, idle ms/step. The first step's idle time (since before the run) is left out."""
    groups: dict[tuple[str, int], list[tuple[str, int, int, float, float]]] = defaultdict(list)
    for i, row in enumerate(trace):
        kind, reqs, tokens, dev, idle = row
        groups[(kind, _bucket(reqs))].append((kind, reqs, tokens, dev, 0.0 if i == 0 else idle))
    head = f"{'step':<8}{'requests':>11}{'steps':>7}{'mean req':>10}{'mean tok':>10}{'device s':>10}" \
           f"{'ms/step':>9}{'idle s':>8}{'idle ms':>9}"  # fmt: skip
    lines = [head]
    for key in sorted(groups):
        rows = groups[key]
        n = len(rows)
        dev, idle = sum(r[3] for r in rows), sum(r[4] for r in rows)
        lines.append(f"{key[0]:<8}{_label(key[1]):>11}{n:>7}{sum(r[1] for r in rows) / n:>10.0f}"
                     f"{sum(r[2] for r in rows) / n:>10.0f}{dev:>10.2f}{1000 * dev / n:>9.2f}"
                     f"{idle:>8.2f}{1000 * idle / n:>9.2f}")  # fmt: skip
    dev, idle = sum(r[3] for r in trace), sum(r[4] for r in trace[1:])
    lines.append(f"total: {len(trace)} steps, device {dev:.2f} s, idle between steps {idle:.2f} s")
    first = ", ".join(f"{kind} {reqs}r {1000 * d:.0f}ms" for kind, reqs, _, d, _ in trace[:8])
    lines.append(f"first steps: {first}")  # a kernel compiling inside the run shows here
    worst = sorted(range(1, len(trace)), key=lambda i: -trace[i][4])[:5]
    gaps = ", ".join(f"#{i} {trace[i][0]} {trace[i][1]}r {1000 * trace[i][4]:.0f}ms" for i in worst)
    lines.append(f"longest idle before a step: {gaps}")  # a stall (a sync, a GC pass) shows here
    return "\n".join(lines)


class GcPauses:
    """The garbage collector's passes while the block runs, by generation: a full pass (generation 2)
    holds the GIL for as long as it walks every tracked object, stalling the scheduler thread."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def report(self) -> str:
        parts = []
        for gen in (0, 1, 2):
            d = [s for g, s in self.passes if g == gen]
            longest = 1000 * max(d, default=0)
            parts.append(f"generation {gen}: {len(d)} passes, {sum(d):.2f} s, longest {longest:.0f} ms")
        return "garbage collector during the run: " + "; ".join(parts)


def summarize_laps(laps: list[tuple[str, int, dict[str, float]]]) -> str:
    """The scheduler thread's host time per step, by phase (StepTimer.lap), grouped as `summarize`
    groups the steps: mean ms per step in each phase; `wait` is the wait for the step's ids (the
    device's work showing through), the rest is host work that must hide behind the next step."""
    from services.scheduler.step_timer import HOST_PHASES

    groups: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for kind, reqs, phases in laps:
        groups[(kind, _bucket(reqs))].append(phases)
    head = f"{'host ms':<8}{'requests':>11}{'steps':>7}" + "".join(f"{p:>10}" for p in HOST_PHASES)
    lines = [head]
    for key in sorted(groups):
        rows = groups[key]
        means = [1000 * sum(r.get(p, 0.0) for r in rows) / len(rows) for p in HOST_PHASES]
        lines.append(f"{key[0]:<8}{_label(key[1]):>11}{len(rows):>7}" + "".join(f"{m:>10.2f}" for m in means))
    totals = {p: sum(r.get(p, 0.0) for *_, r in laps) for p in HOST_PHASES}
    lines.append("host s in all: " + ", ".join(f"{p} {t:.2f}" for p, t in totals.items()))
    return "\n".join(lines)


def triton_variants() -> str:
    """How many variants of each Triton kernel in sglbus_kernels/ this process has compiled, e.g.
    `_extend_kernel 1`: more than one per kernel for a fixed model means per-step specialisation."""
    import importlib
    import pkgutil

    import sglbus_kernels

    counts = []
    for info in pkgutil.iter_modules(sglbus_kernels.__path__):
        for name, obj in vars(importlib.import_module(f"sglbus_kernels.{info.name}")).items():
            caches = getattr(obj, "device_caches", None)
            n = sum(len(c[0]) for c in caches.values()) if isinstance(caches, dict) else 0
            if n:
                counts.append(f"{name} {n}")
    return "Triton kernel variants compiled: " + (", ".join(sorted(set(counts))) or "none")
