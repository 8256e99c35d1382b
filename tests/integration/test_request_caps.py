"""Huge lists in one request, through the served system: 100,000 stop strings, a huge logit_bias,
50,000 token_ids_logprob, top_logprobs_num over the cap get a 400 naming the field, the limit and the
size (native and OpenAI APIs), and the server keeps serving; a long stream with logprobs carries
cumulative rows on /generate and only the new rows per chunk on /v1."""

from __future__ import annotations

import json
from typing import Any

import pytest
from it_helpers import PROMPT, generate, greedy, sse_payloads, stream

from services.gateway.logprob_options import MAX_TOKEN_IDS_LOGPROB, MAX_TOP_LOGPROBS
from shared.sampling_params import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_REGEX, MAX_STOP_REGEX_SIZE


def sp(**params: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, **params}}


# body, what the message must say (each body stays under the test server's 1 MiB body limit)
NATIVE: dict[str, tuple[dict[str, Any], list[str]]] = {
    "stop_100000": (sp(stop=["a"] * 100_000), ["sampling_params.stop", f"at most {MAX_STOP}", "got 100000"]),
    "logit_bias_50000": (
        sp(logit_bias={str(t): 1.0 for t in range(50_000)}),
        ["sampling_params.logit_bias", f"at most {MAX_LOGIT_BIAS}", "got 50000"],
    ),
    "stop_regex_many": (
        sp(stop_regex=["ab"] * 1000),
        ["sampling_params.stop_regex", f"at most {MAX_STOP_REGEX}"],
    ),
    "stop_regex_unrolled": (
        sp(stop_regex=["a{1000000}"]),
        ["stop_regex", str(MAX_STOP_REGEX_SIZE), "1000000"],
    ),
    "token_ids_logprob_50000": (
        {**sp(), "return_logprob": True, "token_ids_logprob": list(range(50_000))},
        ["token_ids_logprob", f"at most {MAX_TOKEN_IDS_LOGPROB}", "got 50000"],
    ),
    "token_ids_logprob_duplicates": (
        {**sp(), "return_logprob": True, "token_ids_logprob": [5, 6, 5]},
        ["token_ids_logprob", "5 more than once"],
    ),
    "top_logprobs_num_over_cap": (
        {**sp(), "return_logprob": True, "top_logprobs_num": 50_000},
        ["top_logprobs_num", str(MAX_TOP_LOGPROBS), "50000"],
    ),
}


@pytest.mark.parametrize("stream_it", [False, True])
@pytest.mark.parametrize("case", list(NATIVE))
def test_huge_lists_are_400_naming_field_limit_and_size(client, case, stream_it):
    body, expected = NATIVE[case]
    r = client.post("/generate", json={**body, "stream": stream_it})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    for part in expected:
        assert part in message, (part, message)


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
OPENAI: dict[str, tuple[str, dict[str, Any], str, list[str]]] = {
    "logit_bias_50000": (
        "/v1/chat/completions",
        {**CHAT, "logit_bias": {str(t): 1 for t in range(50_000)}},
        "logit_bias",
        [f"at most {MAX_LOGIT_BIAS}", "got 50000"],
    ),
    "stop_100000": ("/v1/completions", {"prompt": PROMPT, "stop": ["a"] * 100_000}, "stop", ["100000"]),
    "top_logprobs_21": (
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        ["[0, 20]"],
    ),
    "stop_regex_many": (
        "/v1/completions",
        {"prompt": PROMPT, "stop_regex": ["ab"] * 1000},
        None,
        ["sampling_params.stop_regex", f"at most {MAX_STOP_REGEX}"],
    ),
}


@pytest.mark.parametrize("case", list(OPENAI))
def test_openai_huge_lists_are_400s_in_openai_shape(client, case):
    path, body, param, expected = OPENAI[case]
    r = client.post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    for part in expected:
        assert part in err["message"], (part, err["message"])


def test_still_serving_after_huge_requests(client):
    for case in ("stop_100000", "logit_bias_50000", "token_ids_logprob_50000"):
        assert client.post("/generate", json=NATIVE[case][0]).status_code == 400
    out = generate(client, {"text": PROMPT, "sampling_params": greedy(4)})
    assert out["meta_info"]["completion_tokens"] == 4


ASK = {
    "return_logprob": True,
    "top_logprobs_num": 3,
    "token_ids_logprob": [5, 7],
    "return_text_in_logprobs": True,
}
LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def test_a_long_native_stream_carries_cumulative_logprob_rows(client):
    body = {"text": PROMPT, "sampling_params": greedy(200, ignore_eos=True), **ASK}
    chunks = stream(client, body)
    assert len(chunks) > 10
    prev: dict[str, list] = {k: [] for k in LOGPROB_KEYS}
    for c in chunks:
        meta = c["meta_info"]
        for key in LOGPROB_KEYS:
            rows = meta[key]
            assert len(rows) == len(c["output_ids"]) and rows[: len(prev[key])] == prev[key], key
            prev[key] = rows
        assert [e[1] for e in meta["output_token_logprobs"]] == c["output_ids"]
        assert all(len(top) == 3 and top[0][2] is not None for top in meta["output_top_logprobs"])
        assert all([e[1] for e in row] == [5, 7] for row in meta["output_token_ids_logprobs"])
    final = chunks[-1]
    assert len(final["output_ids"]) == 200
    again = generate(client, body)  # the same rows as a response that is not streamed
    assert [e[1] for e in again["meta_info"]["output_token_logprobs"]] == final["output_ids"]


def test_a_long_openai_stream_carries_each_logprob_row_once(client):
    body = {**CHAT, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r.read().decode().split("\n\n")[:-1])
    chunks = [json.loads(p) for p in payloads[:-1]]
    rows, usage = [], None
    for c in chunks:
        usage = c.get("usage") or usage
        for choice in c["choices"]:
            rows += (choice.get("logprobs") or {}).get("content") or []
    assert usage is not None and len(rows) == usage["completion_tokens"] == 120
    full = client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert [t["token"] for t in rows] == [t["token"] for t in full["choices"][0]["logprobs"]["content"]]
    assert all(len(t["top_logprobs"]) == 2 for t in rows)
