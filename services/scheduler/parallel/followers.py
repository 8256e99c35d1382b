"""Ranks 1..N-1 of a tensor-parallel worker: processes that hold their share of the model and run
each forward rank 0 runs, on the inputs rank 0 sends them.

Rank 0 (the scheduler's process) starts them (`Followers`: `python -m
services.scheduler.parallel.followers`, so nothing of the caller's main module runs again there), and
before each forward sends every follower a header down its pipe: the step's packed host tensor and its
layout (services/scheduler/forward_batch.py), the req_to_token writes made since the last step
(`ReqToTokenPool.take_journal`), the cascade plan's shape and the images' rows' shape; then one device
broadcast carries what only rank 0's device has: the input ids (the step in flight drew some), the new
tokens' KV slots, the written rows' slots, the cascade plan's tensors and the image rows' positions,
and another the image rows (a vision-language model's tower runs on rank 0). Each follower rebuilds the
ForwardBatch, makes the same req_to_token writes and runs the same forward (eager or CUDA graph), so
the all-reduces and the logits' all-gather meet. Sampling happens on rank 0 alone: the tokens reach the
followers as the next step's input ids. Prompt logprobs turn hidden states into logits on every rank
the same way (`logits`).

Failure: a rank is the worker or nothing. Rank 0 watches its followers and ends its own process when
one dies (the supervisor restarts the whole worker, followers included); a follower ends when rank 0
does (its pipe closes, or its parent changes), so no group is left half alive."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.scheduler.forward_batch import ForwardBatch, MultimodalBatch
from sglbus_kernels.cascade_plan import CascadePlan

if TYPE_CHECKING:
    from services.scheduler.model_runner import ModelRunner
    from shared.config import EngineConfig

log = logging.getLogger(__name__)

_CASCADE_FIELDS = ("kv_starts", "members", "tile_first", "tile_count", "tile_len", "tile_row")
_STOP_WAIT_S = 10.0


class Followers:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, config: EngineConfig, model_folder: str, port: int) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pipes: list[multiprocessing.connection.Connection] = []
        self._closing = False
        for rank in range(1, config.tp_size):
            read_fd, write_fd = os.pipe()
            cmd = [sys.executable, "-m", __name__, str(read_fd)]
            proc = subprocess.Popen(cmd, pass_fds=(read_fd,), stdin=subprocess.DEVNULL)
            os.close(read_fd)
            pipe = multiprocessing.connection.Connection(write_fd, readable=False)
            pipe.send_bytes(pickle.dumps((config, model_folder, rank, port, os.getpid())))
            self._procs.append(proc)
            self._pipes.append(pipe)
            log.info("tensor-parallel rank %d started (pid %d)", rank, proc.pid)
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"sglbus-tp{rank}-watch", daemon=True
            ).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """A follower that dies takes this process down (its collectives would wait for it forever)."""
        code = proc.wait()
        if self._closing:
            return
        log.critical(
            "tensor-parallel rank %d exited (%d): stopping this worker (it is restarted whole)", rank, code
        )
        logging.shutdown()
        os._exit(1)

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self._pipes:
            pipe.send_bytes(data)

    def forward(
        self, fb: ForwardBatch, journal: list[tuple[int, int, torch.Tensor]], runner: ModelRunner
    ) -> None:
        """Send the step's inputs; the caller then runs its own forward."""
        assert fb.host is not None, "a step's ForwardBatch comes from ForwardBatch.build"
        host, layout = fb.host
        plan = fb.cascade
        cascade = (
            None
            if plan is None
            else (plan.num_tiles, plan.block_r, [getattr(plan, f).numel() for f in _CASCADE_FIELDS])
        )
        mm = None if fb.mm is None else (tuple(fb.mm.embeds.shape), fb.mm.embeds.dtype)
        self._send(("forward", host.numpy(), layout, [(r, s, t.numel()) for r, s, t in journal], cascade, mm))
        parts = [fb.input_ids, fb.out_cache_loc, *(t for _, _, t in journal)]
        if plan is not None:
            parts += [getattr(plan, f) for f in _CASCADE_FIELDS]
        if fb.mm is not None:
            parts.append(fb.mm.positions)
        runner.tp.broadcast(torch.cat([p.to(torch.int64) for p in parts]))
        if fb.mm is not None:  # the images' rows: computed on this rank only
            runner.tp.broadcast(fb.mm.embeds.contiguous())

    def logits(self, hidden: torch.Tensor, runner: ModelRunner) -> None:
        """Send hidden states [N, H] whose logits rank 0 is about to compute (prompt logprobs)."""
        self._send(("logits", tuple(hidden.shape), hidden.dtype))
        runner.tp.broadcast(hidden.contiguous())

    def close(self, wait: bool = True) -> None:
        """Stop them: each ends its loop when told (wait), else at once (kill)."""
        self._closing = True
        try:
            self._send(("stop",))
        except OSError:  # a follower is gone already
            pass
        deadline = time.monotonic() + (_STOP_WAIT_S if wait else 0.0)
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in self._pipes:
            pipe.close()


def _exit_with_parent(parent: int) -> None:
    """Stop this follower when rank 0 is gone (it may be waiting in a collective, not on its pipe)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def follow(pipe: multiprocessing.connection.Connection) -> None:
    """A follower's life: build its share of the model, then run what rank 0 sends until it stops."""
    from services.scheduler.model_runner import ModelRunner

    config, model_folder, rank, port, parent = pickle.loads(pipe.recv_bytes())
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    fmt = f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.WARNING, format=fmt)
    runner = ModelRunner(config, model_folder, rank=rank, port=port)
    device = runner.device
    with torch.inference_mode():
        while True:
            try:
                message = pickle.loads(pipe.recv_bytes())
            except EOFError:
                break
            kind = message[0]
            if kind == "forward":
                runner.forward(_rebuild(runner, *message[1:]))
            elif kind == "logits":
                shape, dtype = message[1:]
                hidden = runner.tp.broadcast(torch.empty(shape, dtype=dtype, device=device))
                runner.model.logits(hidden)
            else:
                break
    runner.close()


def _rebuild(
    runner: ModelRunner, host: np.ndarray, layout: Any, journal: list, cascade: Any, mm: Any
) -> ForwardBatch:
    """The step's ForwardBatch from rank 0's header and broadcasts, with req_to_token updated."""
    t = layout.num_tokens
    sizes = [t, t, *(n for _, _, n in journal)]
    if cascade is not None:
        sizes += cascade[2]
    if mm is not None:
        sizes.append(mm[0][0])
    payload = runner.tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=runner.device))
    ids, loc, *rest = payload.split(sizes)
    images = None
    if mm is not None:
        embeds = runner.tp.broadcast(torch.empty(mm[0], dtype=mm[1], device=runner.device))
        images = MultimodalBatch(embeds, rest.pop())
    table = runner.req_to_token.table
    for (row, start, n), slots in zip(journal, rest, strict=False):
        table[row, start : start + n] = slots
    plan = None
    if cascade is not None:
        plan = CascadePlan(*rest[len(journal) :], num_tiles=cascade[0], block_r=cascade[1])
    fb = ForwardBatch.from_host(torch.from_numpy(host), layout, loc, runner.device, plan, input_ids=ids)
    fb.store_slots(table)
    return fb if images is None else dataclasses.replace(fb, mm=images)


if __name__ == "__main__":
    follow(multiprocessing.connection.Connection(int(sys.argv[1]), writable=False))
