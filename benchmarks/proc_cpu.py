"""CPU use of the processes of a served run, sampled in a background thread (`--sample-cpu`).

Each process of a launched server (its scheduler, detokenizer, gateway, nats-server) and the
benchmark client itself is read every `interval` seconds; the report gives each one's mean and peak
CPU (100% = one core busy) over the run. A process near 100% for the whole run is the one the others
wait on: a Python service is one core at most, whatever the machine has.
"""

from __future__ import annotations

import os
from collections import defaultdict

import psutil

from benchmarks.sampler import PeriodicSampler

# how a process of `sglbus serve` is named in the report: the first of these its command line contains
_LABELS = (("services.scheduler", "scheduler"), ("services.detokenizer", "detokenizer"),
           ("services.gateway", "gateway"), ("nats-server", "nats-server"),
           ("sglbus.cli", "serve"), ("benchmarks.serving", "client"))  # fmt: skip


def label(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    fallback = os.path.basename(cmdline[0]) if cmdline else "?"
    return next((name for key, name in _LABELS if key in line), fallback)


class ProcessCpu(PeriodicSampler):
    """Context manager: samples the tree of `root_pid` (if any) and this process."""

    def __init__(self, root_pid: int | None, interval: float = 0.5) -> None:
        super().__init__(interval, "proc-cpu")
        self.root_pid = root_pid
        self.samples: defaultdict[str, list[float]] = defaultdict(list)
        self._procs: dict[int, tuple[str, psutil.Process]] = {}
        self._refresh()  # the first reading of each process starts its interval

    def _refresh(self) -> None:
        """Start tracking processes that appeared (a restarted service gets a new pid)."""
        me = psutil.Process()
        found = [me, *me.children(recursive=True)]  # a launched server, --client-processes
        if self.root_pid is not None:
            try:
                root = psutil.Process(self.root_pid)
                found += [root, *root.children(recursive=True)]
            except psutil.Error:
                pass
        for p in found:
            if p.pid in self._procs:
                continue
            try:
                name = "client" if p.pid == os.getpid() else label(p.cmdline())
                p.cpu_percent(None)  # the first call starts the interval
            except psutil.Error:
                continue
            self._procs[p.pid] = (name, p)

    def sample(self) -> None:
        self._refresh()
        for pid, (name, p) in list(self._procs.items()):
            try:
                self.samples[f"{name} ({pid})"].append(p.cpu_percent(None))
            except psutil.Error:
                del self._procs[pid]

    def report(self) -> str:
        rows = [f"{'process':<28} {'mean CPU %':>10} {'peak CPU %':>10}"]
        for name, xs in sorted(self.samples.items(), key=lambda kv: -sum(kv[1]) / len(kv[1])):
            rows.append(f"{name:<28} {sum(xs) / len(xs):>10.1f} {max(xs):>10.1f}")
        return "\n".join(rows)
