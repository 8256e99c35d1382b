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

Each served service freezes the same way once started (`shared.service_main.serve_on_bus`, the
gateway's main); its process lives until it stops, so nothing is unfrozen there.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


def unfreeze() -> None:
    gc.unfreeze()
