"""Typed messages on the bus, one struct per subject direction, msgpack-encoded.

    gateway ──GenerateReq──▶ scheduler ──BatchTokenOut──▶ detokenizer ──BatchTextOut──▶ gateway
       └────────AbortReq────────▲   ▲──────AbortReq (stop string matched)──────┘

A scheduler step produces ONE BatchTokenOut for its whole batch; the detokenizer produces one
BatchTextOut per gateway per step.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.sampling_params import SamplingParams


class GenerateReq(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tokenized request, gateway -> scheduler."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    out_subject: str  # where the detokenizer sends this request's text
    created: float = 0.0  # gateway wall-clock time, for latency accounting


class AbortReq(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Stop requests early. `finish` carries the finish reason when the detokenizer ended the request
    (a stop string, or tokens lost on the bus); without it, the request is aborted (client went away,
    /abort_request). `reannounce`: the detokenizer never heard of the request (its announcement was
    lost), so the scheduler sends its info again with the abort."""

    rids: list[str]
    reason: str = "aborted"
    finish: dict[str, Any] | None = None
    reannounce: bool = False


class NewReqInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the detokenizer needs to know about a request, sent once with its first tokens."""

    rid: str
    out_subject: str
    prompt_tokens: int
    stop: list[str] = []
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    created: float = 0.0


class BatchTokenOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One scheduler step, scheduler -> detokenizer. Parallel lists, one entry per request that
    produced tokens or finished in this step."""

    new_reqs: list[NewReqInfo] = []
    rids: list[str] = []
    token_ids: list[list[int]] = []  # tokens produced this step (usually one)
    cached_tokens: list[int] = []
    # output tokens each request had before this step's: a gap means the bus lost a message
    offsets: list[int] = []
    finish_reasons: list[dict[str, Any] | None] = []


class TextOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    rid: str
    text: str  # delta since the last TextOut of this request
    output_ids: list[int]  # delta
    offset: int = 0  # output ids sent before this delta: a gap means the bus lost a message
    finished: bool = False
    meta: dict[str, Any] = {}  # prompt_tokens, completion_tokens, cached_tokens, finish_reason when finished


class BatchTextOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Detokenizer -> the gateway that owns these requests."""

    outs: list[TextOut] = []


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class Decoder:
    """A reusable msgpack decoder for one message type."""

    def __init__(self, kind: type) -> None:
        self._dec = msgspec.msgpack.Decoder(kind)

    def __call__(self, data: bytes) -> Any:
        return self._dec.decode(data)
