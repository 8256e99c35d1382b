"""The logits-processor seam: everything that reads or changes a batch's logits between the forward
and the draw is a `LogitsProcessor`, and `SampleStep` runs them in order over the rows of the
requests that sample this step.

    admit(req)                   the request got a req_to_token row (again after a retraction: rebuild
                                 its state from the output so far)
    apply(logits, reqs, lens)    change (or read) the rows of `reqs` in place; lens [B, 1] int64 on
                                 the device: each request's output length so far
    on_sample(reqs, tokens)      the tokens drawn for `reqs` (those still alive), [len(reqs)] int64
    release(req)                 the request left the batch (finished, aborted or retracted)

`apply` and `on_sample` compute everything before they write anything, so when one raises nothing
changed and SampleStep can retry it request by request. A processor that no running request uses
costs nothing per step (`active` is False). The grammar bitmask of constrained decoding plugs in the
same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from services.scheduler.request import Req

P = TypeVar("P")


class LogitsProcessor(ABC):
    name = "logits processor"

    def __init__(self) -> None:
        self._users: set[int] = set()  # uids of admitted requests that use this processor

    def uses(self, req: Req) -> bool:
        """Whether `req` needs this processor at all."""
        return True

    @property
    def active(self) -> bool:
        return bool(self._users)

    def admit(self, req: Req) -> None:
        if self.uses(req):
            self._users.add(req.uid)

    def release(self, req: Req) -> None:
        self._users.discard(req.uid)

    @abstractmethod
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], output_lens: torch.Tensor) -> None: ...

    def on_sample(self, reqs: Sequence[Req], tokens: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Most processors keep no state that depends on the drawn tokens."""


class BatchPlan(Generic[P]):
    """A processor's per-batch tensors, rebuilt only when the batch's requests change."""

    def __init__(self, build: Callable[[Sequence[Req]], P | None]) -> None:
        self._build = build
        self._key: tuple[int, ...] | None = None
        self._plan: P | None = None

    def get(self, reqs: Sequence[Req]) -> P | None:
        key = tuple(r.uid for r in reqs)
        if key != self._key:
            self._key, self._plan = key, self._build(reqs)
        return self._plan
