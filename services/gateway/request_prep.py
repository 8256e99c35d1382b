"""What the gateway does to a prompt before it goes on the bus, besides tokenizing it: the limits on its
logprobs (the vocabulary, and prompt logprobs that must fit one bus message), and a request with n > 1
split into a prefill that leaves the prompt in the prefix cache and n samples with seeds of their own."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from services.gateway.generate_input import Prompt
from services.gateway.logprob_meta import LogprobAccumulator
from services.gateway.logprob_options import LogprobOptions

if TYPE_CHECKING:
    from services.gateway.request_state import RequestState

# room in a bus message for everything besides a request's prompt logprob arrays
_BUS_MARGIN = 1 << 16
_SEED_STEP = 0x9E3779B97F4A7C15  # odd: sample j of seed s uses s + j * step (mod 2^63), distinct per j


def warm_prompt(p: Prompt) -> Prompt:
    """Prefill only, to leave the prompt in the prefix cache for its n samples; it computes their prompt
    logprobs too, when asked."""
    sampling = msgspec.structs.replace(p.sampling, n=1, max_new_tokens=0, min_new_tokens=0)
    rid = f"{p.rid}_prefill_{uuid.uuid4().hex[:8]}"
    wants_input = p.logprob is not None and p.logprob.start_len >= 0
    return dataclasses.replace(p, rid=rid, sampling=sampling, logprob=p.logprob if wants_input else None)


def nth_sample(p: Prompt, j: int) -> Prompt:
    seed = p.sampling.sampling_seed
    if seed is not None:
        seed = (seed + j * _SEED_STEP) % (1 << 63)
    sampling = msgspec.structs.replace(p.sampling, n=1, sampling_seed=seed)
    return dataclasses.replace(p, rid=f"{p.rid}_{j}", sampling=sampling)


def check_logprobs(o: LogprobOptions, prompt_len: int, vocab_size: int, max_payload: int) -> None:
    """token_ids_logprob within the vocabulary; prompt logprobs travel in one bus message: refuse
    what the bus cannot carry."""
    bad = [t for t in o.token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token_ids_logprob has id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    rows = max(0, prompt_len - max(o.start_len, 1)) if o.start_len >= 0 else 0
    size = rows * 4 * (1 + 2 * o.top_k + len(o.token_ids or ()))
    limit = max_payload - _BUS_MARGIN
    if size > limit:
        raise ValueError(
            f"prompt logprobs for {rows} positions (top_logprobs_num {o.top_k}, "
            f"{len(o.token_ids or ())} token_ids_logprob) come to {size} bytes, over the bus's "
            f"{limit}-byte limit; raise logprob_start_len or ask for fewer logprobs per position"
        )


def logprob_factory(
    p: Prompt, token_texts: Callable[[list[int]], list[str]], source: RequestState | None
) -> Callable[[], LogprobAccumulator]:
    """A fresh logprob accumulator for p (one per attempt); source: the request whose prompt logprobs
    these are (n > 1: the prompt's prefill; its current attempt's, read as they arrive)."""

    def make() -> LogprobAccumulator:
        assert p.logprob is not None and p.input_ids is not None
        acc = LogprobAccumulator(p.logprob, p.input_ids, token_texts)
        if source is not None and source.logprobs is not None:
            acc.share_input(source.logprobs)
        return acc

    return make
