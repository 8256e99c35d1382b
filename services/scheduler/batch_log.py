"""Batch statistics in SGLang's words, at INFO on the logger the scheduler hands in: a "Decode batch."
line every `DECODE_LOG_INTERVAL` decode steps, a "Prefill batch." line when requests were admitted (at
most one per `PREFILL_LOG_INTERVAL_S`, with the counts since the last one)."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

DECODE_LOG_INTERVAL = 40  # decode steps between two "Decode batch." lines (SGLang's default)
PREFILL_LOG_INTERVAL_S = 1.0  # at most one "Prefill batch." line this often; the counts add up between


class BatchLog:
    """SGLang's batch statistics lines; counting costs a few additions."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.new_seqs = self.new_tokens = self.cached_tokens = 0
        self.last_prefill = -math.inf
        self.decode_steps = self.decode_tokens = 0
        self.last_decode = time.perf_counter()

    def admitted(self, new_tokens: int, cached: int) -> None:
        self.new_seqs += 1
        self.new_tokens += new_tokens
        self.cached_tokens += cached

    def prefill(self, sched: Scheduler, just_admitted: int) -> None:
        now = time.monotonic()
        if now - self.last_prefill < PREFILL_LOG_INTERVAL_S:
            return
        if self.log.isEnabledFor(logging.INFO):
            self.log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d",
                self.new_seqs, self.new_tokens, self.cached_tokens, sched.used_tokens() / sched.kv.size,
                len(sched.running) - just_admitted, len(sched.waiting),
            )  # fmt: skip
        self.new_seqs = self.new_tokens = self.cached_tokens = 0
        self.last_prefill = now

    def decode_step(self, sched: Scheduler, generated: int) -> None:
        self.decode_steps += 1
        self.decode_tokens += generated
        if self.decode_steps % DECODE_LOG_INTERVAL:
            return
        now = time.perf_counter()
        if self.log.isEnabledFor(logging.INFO):
            used = sched.used_tokens()
            self.log.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "gen throughput (token/s): %.2f, #queue-req: %d",
                len(sched.running), used, used / sched.kv.size,
                self.decode_tokens / max(now - self.last_decode, 1e-9), len(sched.waiting),
            )  # fmt: skip
        self.decode_tokens = 0
        self.last_decode = now
