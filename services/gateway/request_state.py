"""One request at the gateway: what its outputs brought so far (text, ids, logprobs, finish), how far
a delta stream has sent it, and its shape as `/generate` answers it: cumulative (`response`) or only
what is new since the last delta (`delta`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.logprob_meta import LogprobAccumulator


@dataclass
class RequestState:
    rid: str
    prompt_tokens: int
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    updated: float = field(default_factory=time.monotonic)  # last output, for the lost-request check
    published: float = 0.0  # perf_counter when the request went on the bus
    logprobs: LogprobAccumulator | None = None
    new_logprobs: Callable[[], LogprobAccumulator] | None = None  # a fresh one, for a restarted attempt
    attempt: int = 1  # the work-queue delivery whose output this state holds
    broken: bool = False  # output of this attempt was lost on the bus: waiting for the next one
    streamed: bool = False  # a stream has sent this request's tokens to its client
    worker: str = ""  # the worker whose detokenizer sent its latest output (the metrics' label)
    first_token_at: float | None = None  # wall clock of its first output token (time to first token)
    last_token_at: float = 0.0  # of its latest output tokens (inter-token latency)
    finished_at: float | None = None
    prompt_ids: list[int] | None = None  # return_prompt_token_ids: sent with every response
    # what delta chunks have sent: text length, output ids, output logprob rows, the prompt's logprobs
    sent_text: int = 0
    sent_ids: int = 0
    sent_rows: int = 0
    sent_input: bool = False

    def response(self) -> dict[str, Any]:
        """The request so far, as /generate answers it (cumulative)."""
        return self._shape(self.text, list(self.output_ids), None)

    def delta(self) -> dict[str, Any]:
        """What is new since the last delta, in the same shape: the new text and output ids
        (`output_offset`: where they go; below the ids sent before when a jump-forward retokenized
        them), the new output logprob rows (the prompt's in the first delta only). O(new tokens)."""
        text = self.text[self.sent_text :]  # the text only grows (a stop_regex cut at the end: nothing)
        start = min(self.sent_ids, len(self.output_ids))
        out = self._shape(text, self.output_ids[start:], (self.sent_rows, not self.sent_input))
        out["output_offset"] = start
        self.sent_text, self.sent_ids = max(self.sent_text, len(self.text)), len(self.output_ids)
        self.sent_input = True
        if self.logprobs is not None:
            self.sent_rows = self.logprobs.output_rows
        return out

    def _shape(self, text: str, ids: list[int], rows: tuple[int, bool] | None) -> dict[str, Any]:
        """rows: (the first output logprob row, whether the prompt's rows go too); None: all of them."""
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "finish_reason": None,
            **self.meta,
        }
        if self.logprobs is not None:
            start, input_side = rows or (0, True)
            meta.update(self.logprobs.meta(self.output_ids, start, input_side))
        if self.finished:
            meta["e2e_latency"] = time.time() - self.created
        out = {"text": text, "output_ids": ids, "meta_info": meta}
        if self.prompt_ids is not None:
            out["prompt_token_ids"] = self.prompt_ids
        return out
