"""The loop the benchmarks' samplers share: `sample()` every `interval_s` seconds on a daemon thread
while the context is entered (StackProfile: where each thread is; ProcessCpu: each process's CPU)."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Self


class PeriodicSampler:
    def __init__(self, interval_s: float, name: str) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
