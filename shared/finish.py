"""Why a request ended: a tagged union that travels the bus as a msgpack map keyed by `type`, the same
keys SGLang's `meta_info.finish_reason` has, so `as_dict` is what `/generate` answers:

    Stop    {"type": "stop", "matched": <token id | stop string | None>}  EOS, a stop id or string, a
                                                                          grammar's end
    Length  {"type": "length", "length": <n>}                              max_new_tokens or the context
    Abort   {"type": "abort", "message": ..., "status_code": <HTTP>}       a client abort (no status), a
                                                                          refused request (4xx), a fault (5xx)

Each API names them its own way (`api_name`); a mistyped reason fails at the sender's decode, not as a
missing key in some response."""

from __future__ import annotations

from typing import Any

import msgspec


class Stop(msgspec.Struct, frozen=True, tag_field="type", tag="stop"):
    matched: int | str | None = None


class Length(msgspec.Struct, frozen=True, tag_field="type", tag="length"):
    length: int


class Abort(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="type", tag="abort"):
    message: str  # required: omit_defaults leaves out only a None status_code
    status_code: int | None = None  # None: aborted on purpose (client, /abort_request), not a failure

    @property
    def failed(self) -> bool:
        """A refusal or a fault (an HTTP status to answer with), not an abort somebody asked for."""
        return self.status_code is not None


FinishReason = Stop | Length | Abort


def as_dict(reason: FinishReason | None) -> dict[str, Any] | None:
    """SGLang's `meta_info.finish_reason`."""
    return None if reason is None else msgspec.to_builtins(reason)


def api_name(reason: FinishReason | None) -> str | None:
    """OpenAI's `finish_reason` (the chat API's `tool_calls` is decided where the calls are parsed)."""
    if reason is None:
        return None
    return "stop" if isinstance(reason, Stop) else "length" if isinstance(reason, Length) else "abort"


def describe(reason: FinishReason | None) -> str:
    """For the log: `stop (2)`, `length (16)`, `abort ('...')`."""
    if reason is None:
        return "?"
    kind, detail = as_dict(reason)["type"], None  # type: ignore[index]
    if isinstance(reason, Stop):
        detail = reason.matched
    elif isinstance(reason, Length):
        detail = reason.length
    else:
        detail = reason.message
    return f"{kind} ({detail!r})" if detail is not None else kind
