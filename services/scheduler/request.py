"""A request inside the scheduler: one state model driven by token counters, no phase flags.

    fill = prompt + output (+ pending)  tokens whose KV the model must have before the next sample
    |<-- num_cached -->|                  slots owned by the radix cache (locked via last_node)
    |<------- num_computed ------->|      slots with KV in the pool (row of req_to_token)
    |<------------------ len(fill) ------------------>|

Each step a running request computes `len(fill) - num_computed` tokens, capped by the chunk budget:
a fresh prompt (prefill), the rest of a long prompt (chunked prefill) or the last sampled token
(decode) are the same operation. It samples once `num_computed == len(fill)`.

`check_request` repeats the gateway's checks on what arrives over the bus: the bus is a trust boundary.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from services.scheduler.constrained.grammar import GrammarSpec, Matcher
from services.scheduler.images import Vision, spans_of, text_ids_in_range
from services.scheduler.radix_cache import TreeNode
from shared.finish import FinishReason, Length, Stop
from shared.grammar_text import grammar_of
from shared.messages import GenerateReq
from shared.reasoning_parser import REASONING_ENDS
from shared.sampling_params import SamplingParams

_uids = itertools.count()


class Dropped:
    """A request released without a word (its output was lost on the bus, or its gateway is gone): it
    ends here and is never reported; the work queue may run it again."""

    __slots__ = ()


DROPPED = Dropped()


class Req:
    __slots__ = (
        "uid", "rid", "prompt", "output", "sampling", "max_new_tokens", "out_subject", "created",
        "arrival", "stop_ids", "num_cached", "num_computed", "last_node", "row", "cached_tokens",
        "finish", "announced", "extend_len", "min_new_mask", "lp", "lp_pos", "lp_end", "lp_in", "lp_out",
        "work_token", "attempt", "pending", "pending_at", "pending_step", "grammar", "matcher",
        "reasoning_end", "queued_tokens", "images",
    )  # fmt: skip

    def __init__(self, msg: GenerateReq, eos_ids: tuple[int, ...], context_len: int = 1 << 62) -> None:
        # per-batch caches key on uid: a client may reuse a rid once its request finished
        self.uid = next(_uids)
        self.rid = msg.rid
        self.prompt: list[int] = msg.input_ids
        self.output: list[int] = []
        self.sampling: SamplingParams = msg.sampling
        self.out_subject = msg.out_subject
        self.created = msg.created
        self.arrival = time.monotonic()  # for the starvation bound
        s = msg.sampling
        self.max_new_tokens = s.max_new_tokens_for(len(msg.input_ids), context_len)
        self.stop_ids = frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else frozenset(eos_ids))
        # min_new_tokens masks EOS and the stop ids (even with ignore_eos, as SGLang does)
        self.min_new_mask = sorted(set(s.stop_token_ids) | set(eos_ids)) if s.min_new_tokens else []
        self.num_cached = 0
        self.num_computed = 0
        self.last_node: TreeNode | None = None
        self.row: int | None = None
        self.cached_tokens: int | None = None  # prompt tokens served by the cache at first admission
        self.finish: FinishReason | Dropped | None = None
        self.announced = False  # the detokenizer has been told about this request
        # the work-queue delivery this run came from: the gateway acknowledges it with the token once
        # it has the output; a later delivery (its worker died) is the next attempt and starts over
        self.work_token = ""
        self.attempt = 1
        self.extend_len = 0  # tokens scheduled in the current step
        # overlap scheduling: 1 while the token this request sampled in the step in flight is still on
        # the device (it counts in fill_len: the next step decodes it); pending_at: its row there;
        # pending_step: that step's number (completing an earlier step leaves it pending)
        self.pending = 0
        self.pending_at = self.pending_step = -1
        # logprobs (see logprobs.py): logits positions lp_pos .. lp_end-1 still owe a prompt logprob;
        # computed rows wait in lp_in / lp_out until the request's next output
        self.lp = msg.logprob
        n = len(msg.input_ids)
        start = -1 if self.lp is None else self.lp.start_len
        self.lp_end = n - 1 if 0 <= start < n else 0
        self.lp_pos = min(max(start, 1) - 1, self.lp_end)
        self.lp_in: list[Any] = []
        self.lp_out: list[Any] = []
        # constrained decoding (services/scheduler/constrained/): the grammar asked for, and the
        # request's matcher once that grammar compiled (None until then, and without a grammar)
        grammar = grammar_of(msg.sampling)
        self.grammar = GrammarSpec(*grammar) if grammar else None
        self.matcher: Matcher | None = None
        self.reasoning_end = msg.reasoning_end  # the grammar waits for this tag (reasoning_gate.py)
        # prompt tokens it will compute, as estimated when it arrived (its worker's load report)
        self.queued_tokens = len(msg.input_ids)
        self.images = spans_of(msg) if msg.images else []  # a vision-language request's (images.py)

    @property
    def fill(self) -> list[int]:
        """The known tokens (a pending one is not among them yet)."""
        return self.prompt + self.output if self.output else self.prompt

    @property
    def fill_len(self) -> int:
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return self.fill_len - self.num_computed

    @property
    def remaining_output(self) -> int:
        return self.max_new_tokens - len(self.output) - self.pending

    @property
    def reads_next_logprobs(self) -> bool:
        """It ends at its prompt without drawing (max_new_tokens 0) yet asked for top or listed
        logprobs: the distribution after the prompt comes back as one output row without a token, as
        SGLang's `output_top_logprobs[0]` (a zero-token gen reading the likely next tokens)."""
        lp = self.lp
        return self.max_new_tokens == 0 and lp is not None and bool(lp.top_k or lp.token_ids)

    def check_finished(self, token: int, context_len: int) -> None:
        """Called after `token` was appended to `output` (the context counts known tokens, not
        fill_len: under overlap the next token may already be in flight)."""
        if token in self.stop_ids:
            self.finish = Stop(token)
        elif len(self.output) >= self.max_new_tokens:
            self.finish = Length(self.max_new_tokens)
        elif len(self.prompt) + len(self.output) >= context_len:
            self.finish = Length(len(self.output))


def check_request(
    msg: GenerateReq, vocab_size: int, context_len: int, pool_size: int, vision: Vision | None = None
) -> str | None:
    """Why the scheduler cannot run this request (the message for its 400), or None. vision: the
    model's, for a vision-language model (its images are checked too)."""
    n = len(msg.input_ids)
    if n == 0:
        return "the prompt is empty"
    s = msg.sampling
    try:
        s.verify(vocab_size)
        s.verify_length(n, context_len)
    except ValueError as e:
        return str(e)
    todo = s.unsupported()
    if todo:
        return f"sampling parameter(s) {', '.join(todo)} cannot be honoured yet; leave them unset"
    if msg.images:
        if vision is None:
            return "this model takes no images (image_data needs a vision-language model such as LLaVA)"
        problem = vision.check(msg, vocab_size)
        if problem is not None:
            return problem
    if not text_ids_in_range(msg, vocab_size):
        return f"input_ids must be token ids in [0, {vocab_size})"
    if n + 1 > pool_size:
        return f"the prompt needs {n + 1} KV slots; the pool has {pool_size}"
    if msg.reasoning_end and msg.reasoning_end not in REASONING_ENDS:
        tags = ", ".join(sorted(REASONING_ENDS))
        return f"reasoning_end must be one of the reasoning parsers' end tags: {tags}"
    lp = msg.logprob
    if lp is not None and (
        not 0 <= lp.top_k <= vocab_size or any(not 0 <= t < vocab_size for t in lp.token_ids)
    ):
        return f"top_k and token_ids of the logprob request must be in [0, {vocab_size})"
    return None
