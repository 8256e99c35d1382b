"""Small helpers shared by the integration tests (request bodies, SSE parsing)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import httpx

PROMPT = "The capital of France is"
META_KEYS = {
    "id",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "finish_reason",
    "e2e_latency",
    "worker_id",
}
VOCAB_SIZE = 49152
CONTEXT_LEN = 8192


def greedy(max_new_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def generate(client: httpx.Client, body: dict[str, Any]) -> Any:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_payloads(lines: Iterable[str]) -> list[str]:
    """The `data:` payloads of an SSE stream, in order (the `[DONE]` marker included)."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        out.append(line[len("data: ") :])
    return out


def stream(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streaming /generate; the decoded chunks, after checking the framing and the end marker."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    payloads = sse_payloads(e for e in events[:-1])
    assert all("\n" not in p for p in payloads), "one data line per event"
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def check_cumulative(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each chunk extends the previous one (text and ids); only the last carries a finish reason.
    Returns the last chunk."""
    prev_text, prev_ids = "", []
    for c in chunks:
        assert c["text"].startswith(prev_text), (prev_text, c["text"])
        assert c["output_ids"][: len(prev_ids)] == prev_ids
        assert c["meta_info"]["completion_tokens"] == len(c["output_ids"])
        prev_text, prev_ids = c["text"], c["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    return chunks[-1]


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
