"""Python's cyclic garbage collector against a step loop (the offline Engine, the served services).

A full collection walks every object the collector tracks, holding the GIL. After start-up those are
hundreds of thousands of objects of the imported libraries (torch, transformers, triton) and of the
model, none of them ever garbage, so each full pass stalls every thread of the process: in the seed
workload on the lent H200 the Engine's scheduler thread stood still 250-400 ms a dozen times, and the
GPU idled meanwhile (docs/benchmarks.md, eighth session). `freeze_startup_objects()`, called once the
Engine has started (model loaded, graphs captured), moves them out of the collector's view
(`gc.freeze`); garbage made later is collected as before, and reference counting still frees frozen
objects outside cycles. `unfreeze()` hands them back when the Engine shuts down, so the cycles of what
it built are collected (the process has one frozen set: with two Engines alive, the first one's
shutdown unfreezes the other's objects too, which costs it only the stalls again).

Then the collector's thresholds are raised for the step loop (`STEP_LOOP_THRESHOLDS`). What a run
builds lives long (each request's token-id lists, its messages, its output), so with Python's
defaults a full pass came every ~70k net allocations and walked all of it: in the seed workload on the
H200 29 full passes of up to 100-120 ms, each longer than a decode step, so the GPU idled behind
them: 0.44 s in a 36 s run, 2.9 s with all four penalties on. With generation 0 collected every 10,000
allocations instead of 700, young garbage is still collected young and no full pass ran in that
workload (idle 0.30 s; 0.39 s with penalties, which went from 0.91-0.95 to 0.98 of the baseline;
docs/benchmarks.md, fourteenth session). `unfreeze()` restores the thresholds found.

Each served service freezes the same way once started (`shared.service_main.serve_on_bus`, the
gateway's main); its process lives until it stops, so nothing is unfrozen there.
"""

from __future__ import annotations

import gc

# (allocations per generation-0 pass, generation-0 passes per generation-1 pass, generation-1
# passes per full pass); Python's defaults are (700, 10, 10)
STEP_LOOP_THRESHOLDS = (10_000, 10, 10)
_saved: list[tuple[int, int, int]] = []


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()
    if not _saved:
        _saved.append(gc.get_threshold())
    gc.set_threshold(*STEP_LOOP_THRESHOLDS)


def unfreeze() -> None:
    gc.unfreeze()
    if _saved:
        gc.set_threshold(*_saved.pop())
