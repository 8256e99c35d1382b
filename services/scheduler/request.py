"""A request inside the scheduler: one state model driven by token counters, no phase flags.

    fill = prompt + output            tokens whose KV the model must have before the next sample
    |<-- num_cached -->|                  slots owned by the radix cache (locked via last_node)
    |<------- num_computed ------->|      slots with KV in the pool (row of req_to_token)
    |<------------------ len(fill) ------------------>|

Each step a running request computes `len(fill) - num_computed` tokens, capped by the chunk budget:
a fresh prompt (prefill), the rest of a long prompt (chunked prefill) or the last sampled token
(decode) are the same operation. It samples once `num_computed == len(fill)`.
"""

from __future__ import annotations

import time
from typing import Any

from services.scheduler.radix_cache import TreeNode
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams


class Req:
    __slots__ = (
        "rid", "prompt", "output", "sampling", "out_subject", "created", "arrival", "stop_ids",
        "num_cached", "num_computed", "last_node", "row", "cached_tokens", "finish", "announced",
        "extend_len", "min_new_mask", "lp", "lp_pos", "lp_end", "lp_in", "lp_out",
    )  # fmt: skip

    def __init__(self, msg: GenerateReq, eos_ids: tuple[int, ...]) -> None:
        self.rid = msg.rid
        self.prompt: list[int] = msg.input_ids
        self.output: list[int] = []
        self.sampling: SamplingParams = msg.sampling
        self.out_subject = msg.out_subject
        self.created = msg.created
        self.arrival = time.monotonic()  # for the starvation bound
        s = msg.sampling
        self.stop_ids = frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else frozenset(eos_ids))
        # min_new_tokens masks EOS and the stop ids (even with ignore_eos, as SGLang does)
        self.min_new_mask = sorted(set(s.stop_token_ids) | set(eos_ids)) if s.min_new_tokens else []
        self.num_cached = 0
        self.num_computed = 0
        self.last_node: TreeNode | None = None
        self.row: int | None = None
        self.cached_tokens: int | None = None  # prompt tokens served by the cache at first admission
        self.finish: dict[str, Any] | None = None
        self.announced = False  # the detokenizer has been told about this request
        self.extend_len = 0  # tokens scheduled in the current step
        # logprobs (see logprobs.py): logits positions lp_pos .. lp_end-1 still owe a prompt logprob;
        # computed rows wait in lp_in / lp_out until the request's next output
        self.lp = msg.logprob
        n = len(msg.input_ids)
        start = -1 if self.lp is None else self.lp.start_len
        self.lp_end = n - 1 if 0 <= start < n else 0
        self.lp_pos = min(max(start, 1) - 1, self.lp_end)
        self.lp_in: list[Any] = []
        self.lp_out: list[Any] = []

    @property
    def fill(self) -> list[int]:
        return self.prompt + self.output if self.output else self.prompt

    @property
    def fill_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return self.fill_len - self.num_computed

    @property
    def remaining_output(self) -> int:
        return self.sampling.max_new_tokens - len(self.output)

    def check_finished(self, token: int, context_len: int) -> None:
        """Called after `token` was appended to `output`."""
        if token in self.stop_ids:
            self.finish = {"type": "stop", "matched": token}
        elif len(self.output) >= self.sampling.max_new_tokens:
            self.finish = {"type": "length", "length": self.sampling.max_new_tokens}
        elif self.fill_len >= context_len:
            self.finish = {"type": "length", "length": len(self.output)}
