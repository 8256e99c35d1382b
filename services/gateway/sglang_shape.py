"""SGLang's `/generate` response shape, from the gateway's typed request states: one dict per prompt
(`text`, `output_ids`, `meta_info`), cumulative when streaming (SGLang's chunks repeat everything so
far), a list for batch input or n > 1, stream chunks of a batch with `index`."""

from __future__ import annotations

import time
from typing import Any

from services.gateway.request_state import Delta, RequestState
from shared.finish import as_dict


def response(st: RequestState) -> dict[str, Any]:
    """The request so far."""
    meta = {
        "id": st.label,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": len(st.output_ids),
        "cached_tokens": st.cached_tokens,
        "finish_reason": as_dict(st.finish),
        "worker_id": st.worker,  # the worker (scheduler + detokenizer) that served it
        **st.logprob_meta(),
    }
    if st.finished:
        meta["e2e_latency"] = time.time() - st.created
    out = {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}
    if st.prompt_ids is not None:
        out["prompt_token_ids"] = st.prompt_ids
    return out


def results(states: list[RequestState], is_batch: bool) -> dict[str, Any] | list[dict[str, Any]]:
    out = [response(st) for st in states]
    return out if is_batch else out[0]


def stream_chunk(event: Delta, is_batch: bool) -> dict[str, Any]:
    chunk = response(event.state)
    if is_batch:
        chunk["index"] = event.index
    return chunk


def error_body(st: RequestState) -> dict[str, Any] | None:
    """`{"error": {"message", "code"}}` when the server failed the request (a client's own abort is a
    normal response), else None."""
    f = st.failure
    return None if f is None else {"error": {"message": f.message, "code": f.status_code}}
