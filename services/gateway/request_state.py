"""One request at the gateway: what its outputs brought so far (text, ids, logprobs, its finish
reason), how far a stream has sent it, and `delta()`: the typed event of what is new since the last
one. The RequestManager yields these events; one shaper per API turns them (and finished states) into
responses: `sglang_shape.py` (`/generate`, cumulative), `openai_responses.py` (OpenAI's deltas)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.logprob_meta import LogprobAccumulator
from shared.finish import Abort, FinishReason


@dataclass
class RequestState:
    rid: str  # the gateway's own id for it on the bus: `<gateway id>-<boot>-<n>`, never reused
    prompt_tokens: int
    created: float
    label: str = ""  # the client's rid (responses show it; it may repeat across owners)
    owner: str = ""  # who may abort it by its label (http_auth.Caller.owner)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache had (known when it finished)
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
    # n > 1: the prompt's prefill and its samples, one work-queue delivery (acknowledged once all ended)
    group: list[RequestState] | None = None
    dispatch: Any = None  # router.Dispatch: the work-queue message it went in, and to which worker
    # what deltas have sent: text length, output ids, output logprob rows, the prompt's logprobs
    sent_text: int = 0
    sent_ids: int = 0
    sent_rows: int = 0
    sent_input: bool = False

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def failure(self) -> Abort | None:
        """The abort the server ended it with (a refusal or a fault), or None."""
        f = self.finish
        return f if isinstance(f, Abort) and f.failed else None

    def end(self, finish: FinishReason) -> None:
        self.finish, self.finished_at = finish, time.time()

    def logprob_meta(self, start: int = 0, input_side: bool = True) -> dict[str, Any]:
        """Its logprobs in SGLang's meta_info keys: the prompt's (unless input_side is False) and the
        output rows from `start` on; {} when it asked for none."""
        if self.logprobs is None:
            return {}
        return self.logprobs.meta(self.output_ids, start, input_side)

    def delta(self, index: int = 0) -> Delta:
        """What is new since the last delta: O(new tokens)."""
        text = self.text[self.sent_text :]  # the text only grows (a stop_regex cut at the end: nothing)
        start = min(self.sent_ids, len(self.output_ids))
        lp = self.logprob_meta(self.sent_rows, not self.sent_input) if self.logprobs is not None else None
        event = Delta(self, index, text, self.output_ids[start:], start, lp, self.finish)
        self.sent_text, self.sent_ids = max(self.sent_text, len(self.text)), len(self.output_ids)
        self.sent_input = True
        if self.logprobs is not None:
            self.sent_rows = self.logprobs.output_rows
        return event


@dataclass(frozen=True)
class Delta:
    """One request's event: the text and output ids new since its last event (`output_offset`: where
    the ids go; below those sent before when a jump-forward retokenized them), its new output logprob
    rows in meta_info keys (the prompt's with the first event; None when it asked for none), and its
    finish reason once it ended. `state`: the request so far, for APIs whose chunks are cumulative.
    `index`: the request's place among those of its call."""

    state: RequestState
    index: int
    text: str
    output_ids: list[int]
    output_offset: int
    logprobs: dict[str, Any] | None
    finish: FinishReason | None
