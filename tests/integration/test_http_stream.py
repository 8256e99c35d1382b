"""SSE streaming of `/generate` over a real uvicorn: SGLang's documented client loop works unchanged,
chunks are `data: {json}` with cumulative text, `data: [DONE]` ends the stream."""

from __future__ import annotations

import contextlib
import io
import json

import requests
from it_helpers import PROMPT, check_cumulative, generate, greedy, same_output, stream


def sglang_doc_streaming_example(base_url: str) -> None:
    """SGLang's streaming example (docs, "Sampling Parameters" page), verbatim but for the URL."""
    response = requests.post(
        f"{base_url}/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 32,
            },
            "stream": True,
        },
        stream=True,
    )

    prev = 0
    for chunk in response.iter_lines(decode_unicode=False):
        chunk = chunk.decode("utf-8")
        if chunk and chunk.startswith("data:"):
            if chunk == "data: [DONE]":
                break
            data = json.loads(chunk[5:].strip("\n"))
            output = data["text"].strip()
            print(output[prev:], end="", flush=True)
            prev = len(output)
    print("")


def test_sglang_doc_streaming_example_prints_the_greedy_text(srv, client):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        sglang_doc_streaming_example(srv.url)
    ref = generate(client, {"text": "The capital of France is", "sampling_params": greedy(32)})
    assert printed.getvalue() == ref["text"].strip() + "\n"
    assert len(ref["text"].strip()) > 10


def test_stream_chunks_are_cumulative_and_end_with_done(client):
    sp = greedy(10, ignore_eos=True)
    chunks = stream(client, {"text": PROMPT, "sampling_params": sp})
    assert len(chunks) >= 2, "tokens must arrive in several chunks, not all at the end"
    last = check_cumulative(chunks)
    assert all("index" not in c for c in chunks), "a single prompt's chunks carry no index"
    ref = generate(client, {"text": PROMPT, "sampling_params": sp})
    assert same_output(last, ref)
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert last["meta_info"]["id"] == chunks[0]["meta_info"]["id"]
    assert last["meta_info"]["e2e_latency"] > 0
    assert set(last["meta_info"]) == set(ref["meta_info"])


def test_stream_never_sends_text_that_a_stop_string_trims(client):
    sp = greedy(16, ignore_eos=True)
    ref = generate(client, {"text": PROMPT, "sampling_params": sp})
    stop = ref["text"][8:11]
    cut = ref["text"].index(stop)
    chunks = stream(client, {"text": PROMPT, "sampling_params": {**sp, "stop": stop}})
    last = check_cumulative(chunks)
    assert last["text"] == ref["text"][:cut]
    assert all(len(c["text"]) <= cut for c in chunks)
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_batch_stream_carries_index(client):
    texts = ["The capital of France is", "My favourite fruit is"]
    params = [greedy(4, ignore_eos=True), greedy(6, ignore_eos=True)]
    chunks = stream(client, {"text": texts, "sampling_params": params, "rid": "bstream"})
    assert {c["index"] for c in chunks} == {0, 1}
    ref = generate(client, {"text": texts, "sampling_params": params})
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        last = check_cumulative(mine)
        assert all(c["meta_info"]["id"] == f"bstream_{i}" for c in mine)
        assert same_output(last, ref[i])
        assert last["meta_info"]["completion_tokens"] == params[i]["max_new_tokens"]
