"""Device time of each step on CUDA: an event before the step's forward and one after its sampling
launch, read when the step completes (its ids are on the host by then, so reading waits for nothing).
The sums go to the scheduler's stats: `device_s` against the wall time says how busy the GPU was,
and the split by mode (decode-only steps vs steps that prefill) says where it went. On CPU the
forward is synchronous and `forward_s` already is the device time; nothing is recorded.

With `trace` set to a list, each step also appends (mode, requests, tokens, device s, idle s before
it): the idle time is the GPU's wait between the previous step's end and this one's start, i.e. host
work that did not hide behind the device's (`python -m benchmarks.offline --step-trace`). With `laps`
set to a list as well, each step appends (kind, requests, {phase: host s}): where the scheduler thread's
time went, phase by phase (`lap`; `HOST_PHASES` in order), which says what to cut when the GPU idles.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from services.scheduler.forward_batch import ForwardMode

Marks = tuple[torch.cuda.Event, torch.cuda.Event, ForwardMode, int, int]
# the scheduler thread's phases, in step order; "between" is the service's work between two steps;
# "inputs", "slots" and "batch" build the step's batch (StepInputs.collect; the KV slots and cascade
# plan; the ForwardBatch, its copy and the req_to_token scatter); "send" hands the ready output to the
# bus under overlap scheduling (Scheduler.step's `send_early`)
HOST_PHASES = ("between", "schedule", "inputs", "slots", "batch", "forward", "sample", "send", "wait",
               "complete", "release")  # fmt: skip


class StepTimer:
    def __init__(self, device: torch.device, stats: dict[str, Any]) -> None:
        self.on = device.type == "cuda"
        self.stats = stats
        self.trace: list[tuple[str, int, int, float, float]] | None = None
        self._last: torch.cuda.Event | None = None  # the previous step's end, for the trace's idle time
        self.laps: list[tuple[str, int, dict[str, float]]] | None = None
        self._lap_t = 0.0
        self._step_laps: defaultdict[str, float] = defaultdict(float)
        self._step: tuple[str, int] = ("none", 0)  # the launched step's kind and requests
        # (while tracing) wall time of the first step's launch and of the last step's completion
        self.first_launch: float | None = None
        self.last_done: float | None = None
        for key in ("device_s", "device_decode_s", "device_extend_s", "decode_steps", "extend_steps"):
            stats[key] = 0 if key.endswith("steps") else 0.0

    def begin(self) -> torch.cuda.Event | None:
        if not self.on:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        if self.trace is not None and self.first_launch is None:
            self.first_launch = time.perf_counter()
        return start

    def end(
        self, start: torch.cuda.Event | None, mode: ForwardMode, requests: int, tokens: int
    ) -> Marks | None:
        if start is None:
            return None
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        return start, stop, mode, requests, tokens

    def collect(self, marks: Marks | None) -> None:
        if marks is None:
            return
        start, stop, mode, requests, tokens = marks
        stop.synchronize()  # one event record past the step's ids, which the host already waited for
        s = start.elapsed_time(stop) / 1000
        kind = "decode" if mode is ForwardMode.DECODE else "extend"
        self.stats["device_s"] += s
        self.stats[f"device_{kind}_s"] += s
        self.stats[f"{kind}_steps"] += 1
        if self.trace is not None:
            idle = self._last.elapsed_time(start) / 1000 if self._last is not None else 0.0
            self.trace.append((kind, requests, tokens, s, idle))
            self.last_done = time.perf_counter()
        self._last = stop

    # -- host phases (only while `laps` is a list) -----------------------------------------------
    def lap_begin(self) -> None:
        if self.laps is not None:
            now = time.perf_counter()
            if self._step_laps:
                self._step_laps["between"] += now - self._lap_t
                self.laps.append((*self._step, dict(self._step_laps)))
            self._step_laps, self._step, self._lap_t = defaultdict(float), ("none", 0), now

    def lap(self, phase: str, mode: ForwardMode | None = None, requests: int = 0) -> None:
        """The host time since the last lap goes to `phase`; `mode`, `requests`: the launched step's."""
        if self.laps is not None:
            now = time.perf_counter()
            self._step_laps[phase] += now - self._lap_t
            self._lap_t = now
            if mode is not None:
                self._step = ("decode" if mode is ForwardMode.DECODE else "extend", requests)
