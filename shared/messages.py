"""Typed messages on the bus, one struct per subject direction, msgpack-encoded.

    gateway ──GenerateReq──▶ scheduler ──BatchTokenOut──▶ detokenizer ──BatchTextOut──▶ gateway
       └────────AbortReq────────▲   ▲──────AbortReq (stop string matched)──────┘

A scheduler step produces ONE BatchTokenOut for its whole batch; the detokenizer produces one
BatchTextOut per gateway per step.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.finish import FinishReason
from shared.sampling_params import SamplingParams

# a request that crashed its scheduler this many times while it ran alone ends with an error instead of
# another try (services/scheduler/quarantine.py: give-backs and crashed batches it was merely in do
# not count)
MAX_CRASHES = 3
# deliveries of one work-queue message allowed for: the gap in attempts a gateway leaves when it routes a
# request again (`GenerateReq.attempt_base`), and the limit of a scheduler that cannot keep its crash
# record (its file cannot be written), where every delivery counts
MAX_DELIVERIES = 10


class LogprobReq(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What logprobs a request wants (present only when it asked for any)."""

    start_len: int = -1  # first prompt position with an input logprob; -1: output tokens only
    top_k: int = 0  # top logprobs per position
    token_ids: list[int] = []  # logprobs of these ids at every position


def image_placeholder(vocab_size: int, image_hash: int) -> int:
    """The id every placeholder slot of an image holds: past the vocabulary, the same for the same
    picture and (almost always) different for another, so the prefix cache tells images apart."""
    return vocab_size + image_hash % (1 << 30)


class ImageInput(msgspec.Struct, kw_only=True):
    """One image of a vision-language request: its placeholder tokens are input_ids[offset : offset +
    length] (each `image_placeholder(vocab_size, hash)`), its pixels the
    preprocessed image before normalisation (shared/media.py `ClipPreprocess.uint8`): uint8
    [tiles, H, W, 3]."""

    offset: int
    length: int
    hash: int
    pixels: bytes  # `tiles` images of height x width (LLaVA-NeXT's base image and grid; else one)
    height: int
    width: int
    tiles: int = 1
    # the picture's size as sent, before the processor (LLaVA-NeXT's rows depend on it; 0: unknown)
    image_height: int = 0
    image_width: int = 0


class GenerateReq(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tokenized request, gateway -> scheduler."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    out_subject: str  # where the detokenizer sends this request's text
    created: float = 0.0  # gateway wall-clock time, for latency accounting
    logprob: LogprobReq | None = None
    # require_reasoning: the tag that ends the model's reasoning ("</think>"); a grammar applies only
    # to the output after it (services/scheduler/constrained/reasoning_gate.py). "": from the start
    reasoning_end: str = ""
    # requests that run on the same scheduler once this one ended (the n > 1 samples after the
    # prefill that leaves their prompt in the prefix cache); one work-queue delivery with it
    then: list[GenerateReq] = []
    # attempts before this message: a request the gateway routed again (its worker died) counts on
    # from there, so each delivery of the new message is a higher attempt than any of the old one's
    attempt_base: int = 0
    # a vision-language model's images, in prompt order (their placeholders are in input_ids)
    images: list[ImageInput] = []


class LogprobOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Logprobs one request gained since its last output, as raw little-endian arrays (float32 values,
    int32 ids; msgpack bin, never lists of floats). Input rows continue the prompt positions sent
    before (the first is max(start_len, 1)); output rows belong to this output's token ids, in order.
    Shapes: token [m], top [m, top_k], ids [m, len(token_ids)]. A request that ends at its prompt
    (max_new_tokens 0) and asked for top or listed logprobs has one output top / ids row (the next
    position's) and no token row: there is no token."""

    input_token: bytes = b""
    input_top_val: bytes = b""
    input_top_idx: bytes = b""
    input_ids_val: bytes = b""
    output_token: bytes = b""
    output_top_val: bytes = b""
    output_top_idx: bytes = b""
    output_ids_val: bytes = b""


class AbortReq(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Stop requests early. `finish` carries the finish reason when the detokenizer ended the request
    (a stop string); without it, the request is aborted (client went away, /abort_request).
    `restart`: output of these requests was lost on the bus (or the detokenizer never heard of them):
    the scheduler drops them without a word and gives them back to the work queue, which delivers
    them again as a new attempt that starts over."""

    rids: list[str]
    reason: str = "aborted"
    finish: FinishReason | None = None
    restart: bool = False


class NewReqInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the detokenizer needs to know about a request, sent once with its first tokens."""

    rid: str
    out_subject: str
    stop: list[str] = []
    stop_regex: list[str] = []
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    created: float = 0.0
    # the work-queue delivery this run of the request came from: its count (a higher attempt starts
    # over and replaces a lower one) and the token the gateway acknowledges once it has the output
    attempt: int = 1
    work_token: str = ""


class BatchTokenOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One scheduler step, scheduler -> detokenizer. Parallel lists, one entry per request that
    produced tokens or finished in this step."""

    new_reqs: list[NewReqInfo] = []
    rids: list[str] = []
    token_ids: list[list[int]] = []  # tokens produced this step (usually one)
    cached_tokens: list[int] = []
    # output tokens each request had before this step's: a gap means the bus lost a message
    offsets: list[int] = []
    finish_reasons: list[FinishReason | None] = []
    logprobs: list[LogprobOut | None] = []  # empty when no request in the step asked for logprobs


class TextOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    rid: str
    text: str  # delta since the last TextOut of this request
    text_offset: int = (
        0  # characters before this delta: lower than the text held only when a stop_regex cut it
    )
    output_ids: list[int]  # delta
    offset: int = 0  # output ids sent before this delta: a gap means the bus lost a message
    attempt: int = 1  # which delivery of the request produced it (see NewReqInfo)
    work_token: str = ""  # on the final output: the gateway acknowledges the request with it
    finish: FinishReason | None = None  # on the final output
    cached_tokens: int = 0  # on the final output: prompt tokens found in the prefix cache
    logprobs: LogprobOut | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None


class BatchTextOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Detokenizer -> the gateway that owns these requests."""

    outs: list[TextOut] = []
    worker: str = ""  # the worker (scheduler + detokenizer) that produced them: the gateway's metrics


class WorkerLoad(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A scheduler's load, as the router weighs it (on every KvEvents message)."""

    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued for admission (held n > 1 samples included)
    # prompt tokens the queued requests still have to compute: each one's length less the leading
    # blocks it found cached, or computed by a request that arrived before it, when it arrived
    waiting_tokens: int = 0
    kv_used: int = 0  # KV slots in use by requests (not the evictable cache)
    kv_total: int = 0  # the KV pool's size
    max_running: int = 0  # the most requests it runs at once
    max_queued: int = 0  # its admission bound on queued requests (0: none)
    # requests taken off its own lane of the work queue since this run started (first deliveries):
    # a router counts those it knows were routed there and are not yet among them as on their way
    received: int = 0


class KvEvents(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one scheduler's prefix cache stored and evicted since its last message (shared/kv_blocks.py
    hashes), batched per step, with its load. `seq` counts this run's messages from 1 (a new run has a
    new `instance`): a gateway that sees a gap asks for a snapshot. `cleared`: the cache was emptied
    (a flush) before `stored` was applied."""

    worker: str
    instance: str
    seq: int
    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False
    load: WorkerLoad = msgspec.field(default_factory=WorkerLoad)


class RouteNote(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A gateway routed a prompt to a worker (or, `released`, that prompt has been computed or ended),
    for the other gateways' routers: until the worker's KvEvents show its blocks, every gateway
    counts them as on their way there, and the request in that worker's load."""

    gateway: str
    id: int
    worker: str = ""
    blocks: list[int] = []
    new_tokens: int = 0
    released: bool = False


class KvSnapshot(msgspec.Struct, kw_only=True):
    """Every block a scheduler's prefix cache holds, as of its KvEvents message `seq`."""

    worker: str
    instance: str
    seq: int
    blocks: list[int]
    load: WorkerLoad


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def encode_split(msg: BatchTokenOut | BatchTextOut, limit: int) -> list[bytes]:
    """One message, or when it would exceed `limit` bytes (the bus's max payload), several, each with
    whole requests: a request's item (with its NewReqInfo) is never split, so order per request holds.
    An item alone over the limit still goes out alone (the gateway refuses requests that could)."""
    data = encode(msg)
    if len(data) <= limit:
        return [data]
    if isinstance(msg, BatchTokenOut):
        parts: list = _split_token_out(msg)
    else:
        parts = [BatchTextOut(outs=[o], worker=msg.worker) for o in msg.outs]
    out: list[bytes] = []
    group: list = []  # single-request parts, merged greedily up to the limit
    size = 0
    for part in parts:
        n = len(encode(part))
        if group and size + n > limit:
            out.append(encode(_merge(group)))
            group, size = [], 0
        group.append(part)
        size += n
    if group:
        out.append(encode(_merge(group)))
    return out


def _split_token_out(msg: BatchTokenOut) -> list[BatchTokenOut]:
    infos = {info.rid: info for info in msg.new_reqs}
    lps = msg.logprobs or [None] * len(msg.rids)
    return [
        BatchTokenOut(
            new_reqs=[infos[rid]] if rid in infos else [],
            rids=[rid],
            token_ids=[tok],
            cached_tokens=[cached],
            offsets=[off],
            finish_reasons=[fin],
            logprobs=[lp] if msg.logprobs else [],
        )  # fmt: skip
        for rid, tok, cached, off, fin, lp in zip(
            msg.rids, msg.token_ids, msg.cached_tokens, msg.offsets, msg.finish_reasons, lps, strict=True
        )
    ]


def _merge(parts: list) -> BatchTokenOut | BatchTextOut:
    if isinstance(parts[0], BatchTextOut):
        return BatchTextOut(outs=[o for p in parts for o in p.outs], worker=parts[0].worker)
    out = BatchTokenOut()
    for p in parts:
        out.new_reqs += p.new_reqs
        out.rids += p.rids
        out.token_ids += p.token_ids
        out.cached_tokens += p.cached_tokens
        out.offsets += p.offsets
        out.finish_reasons += p.finish_reasons
        out.logprobs += p.logprobs
    if not any(out.logprobs):
        out.logprobs = []
    return out


class Decoder:
    """A reusable msgpack decoder for one message type."""

    def __init__(self, kind: type) -> None:
        self._dec = msgspec.msgpack.Decoder(kind)

    def __call__(self, data: bytes) -> Any:
        return self._dec.decode(data)
