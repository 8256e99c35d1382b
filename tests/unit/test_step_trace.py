"""The step trace's summaries (benchmarks/step_trace.py): what `--step-trace` prints."""

from __future__ import annotations

import gc

from benchmarks.step_trace import GcPauses, summarize


def test_the_longest_idle_gaps_name_their_steps():
    trace = [("extend", 70, 8000, 0.2, 5.0)]  # the first step's idle (since before the run) is left out
    trace += [("decode", 100 - i, 100 - i, 0.01, 0.001) for i in range(20)]
    trace[7] = ("decode", 93, 93, 0.01, 0.4)  # a 400 ms stall
    text = summarize(trace)
    assert "idle between steps 0.42 s" in text
    assert "longest idle before a step: #7 decode 93r 400ms" in text


def test_gc_pauses_counts_the_passes_inside_the_block_only():
    with GcPauses() as pauses:
        gc.collect()
    gc.collect()  # after the block: not counted
    # (an automatic young pass may land in the block too: only the full ones are certain)
    assert sum(g == 2 for g, _ in pauses.passes) == 1
    assert pauses.report().startswith("garbage collector during the run: generation 0: ")
    assert "generation 2: 1 passes" in pauses.report()
