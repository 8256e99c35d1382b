"""Bad input to `/generate` gets HTTP 400 with a JSON message naming the field and what is allowed;
null means "the default" for every SGLang sampling parameter; the server keeps serving afterwards."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import MAX_BODY_BYTES
from it_helpers import CONTEXT_LEN, PROMPT, VOCAB_SIZE, generate, greedy


def sp(**params: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, **params}}


# (body: dict, or raw bytes), substrings the error message must contain
BAD: dict[str, tuple[Any, list[str]]] = {
    "invalid_json": (b'{"text": "hi", ', ["invalid JSON"]),
    "empty_body": (b"", ["empty", "JSON object"]),
    "not_an_object": ([1, 2, 3], ["JSON object"]),
    "text_and_input_ids": ({"text": "hi", "input_ids": [1, 2]}, ["text", "input_ids", "exactly one"]),
    "neither_text_nor_ids": ({"sampling_params": {"max_new_tokens": 1}}, ["text", "input_ids"]),
    "empty_text": ({"text": ""}, ["text", "empty"]),
    "empty_text_list": ({"text": []}, ["text", "empty"]),
    "empty_text_in_batch": ({"text": ["hi", ""]}, ["text", "empty"]),
    "empty_input_ids": ({"input_ids": []}, ["input_ids", "non-empty"]),
    "empty_row_of_input_ids": ({"input_ids": [[1, 2], []]}, ["input_ids", "empty"]),
    "text_not_a_string": ({"text": 5}, ["text", "string"]),
    "input_id_too_large": (
        {"input_ids": [1, VOCAB_SIZE]},
        ["input_ids", str(VOCAB_SIZE), f"[0, {VOCAB_SIZE})"],
    ),
    "input_id_negative": ({"input_ids": [-1, 5]}, ["input_ids", "-1", f"[0, {VOCAB_SIZE})"]),
    "input_id_not_int": ({"input_ids": [1, "x"]}, ["input_ids", "integer"]),
    "temperature_negative": (sp(temperature=-1), ["temperature", ">= 0"]),
    "temperature_type": (sp(temperature="hot"), ["temperature"]),
    "top_p_zero": (sp(top_p=0), ["top_p", "0 < top_p <= 1"]),
    "top_p_above_one": (sp(top_p=1.5), ["top_p", "0 < top_p <= 1"]),
    "top_k_zero": (sp(top_k=0), ["top_k", "-1", ">= 1"]),
    "top_k_minus_two": (sp(top_k=-2), ["top_k", "-1", ">= 1"]),
    "min_p_above_one": (sp(min_p=1.5), ["min_p", "0 <= min_p <= 1"]),
    "frequency_penalty_3": (sp(frequency_penalty=3), ["frequency_penalty", "-2", "2"]),
    "presence_penalty_minus_3": (sp(presence_penalty=-3), ["presence_penalty", "-2", "2"]),
    "repetition_penalty_zero": (
        sp(repetition_penalty=0),
        ["repetition_penalty", "0 < repetition_penalty <= 2"],
    ),
    "repetition_penalty_2_5": (
        sp(repetition_penalty=2.5),
        ["repetition_penalty", "0 < repetition_penalty <= 2"],
    ),
    "max_new_tokens_negative": (sp(max_new_tokens=-1), ["max_new_tokens", ">= 0"]),
    "min_above_max_new_tokens": (
        sp(max_new_tokens=2, min_new_tokens=5),
        ["min_new_tokens", "max_new_tokens"],
    ),
    "regex_and_json_schema": (sp(regex="a+", json_schema='{"type": "string"}'), ["regex", "json_schema"]),
    "stop_token_id_outside_vocab": (sp(stop_token_ids=[VOCAB_SIZE]), ["stop_token_ids", str(VOCAB_SIZE)]),
    "n_zero": (sp(n=0), ["n", ">= 1"]),
    "prompt_longer_than_context": (
        {"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 1}},
        ["9000 tokens", str(CONTEXT_LEN - 1), "context"],
    ),
    "prompt_plus_max_new_tokens_beyond_context": (  # SGLang's message, naming both numbers
        {"input_ids": [1] * 8000, "sampling_params": {"max_new_tokens": 1000}},
        [f"maximum context length of {CONTEXT_LEN} tokens", "9000 tokens", "8000 tokens", "1000 tokens"],
    ),
    "sampling_params_not_an_object": ({"text": "hi", "sampling_params": 3}, ["sampling_params", "object"]),
    "sampling_params_list_wrong_length": (
        {"text": ["a", "b"], "sampling_params": [{}]},
        ["sampling_params", "1", "2 prompts"],
    ),
    "rid_list_wrong_length": ({"text": ["a", "b"], "rid": ["x"]}, ["rid", "2"]),
    "rid_list_duplicates": ({"text": ["a", "b"], "rid": ["x", "x"]}, ["rid", "unique"]),
    "stream_not_bool": ({"text": "hi", "stream": "yes"}, ["stream", "true or false"]),
    "unknown_sampling_param": (
        sp(temprature=0),
        ["unknown sampling parameter", "'temprature'", "temperature"],
    ),
    "unknown_field": ({"text": "hi", "max_tokens": 3}, ["unknown field", "'max_tokens'", "sampling_params"]),
    "b64_without_flat": (
        {"text": "hi", "return_logprob": True, "return_flat_raw_top_logprobs_b64": True},
        ["return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs"],
    ),
    "top_logprobs_without_return_logprob": (
        {"text": "hi", "top_logprobs_num": 3},
        ["top_logprobs_num", "return_logprob: true"],
    ),
    "top_logprobs_negative": (
        {"text": "hi", "return_logprob": True, "top_logprobs_num": -1},
        ["top_logprobs_num", "[0, 1024]"],
    ),
    "logprob_start_len_below_minus_one": (
        {"text": "hi", "return_logprob": True, "logprob_start_len": -2},
        ["logprob_start_len", "-1 (output only)"],
    ),
    "token_ids_logprob_outside_vocab": (
        {"text": "hi", "return_logprob": True, "token_ids_logprob": [VOCAB_SIZE]},
        ["token_ids_logprob", f"[0, {VOCAB_SIZE})"],
    ),
    "return_logprob_list_of_wrong_length": (
        {"text": ["a", "b"], "return_logprob": [True]},
        ["return_logprob", "one per prompt"],
    ),
    "n_differs_across_batch": (
        {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]},
        ["sampling_params.n", "same for every prompt"],
    ),
    "image_data_text_model": ({"text": "hi", "image_data": "cat.png"}, ["image_data", "takes no images"]),
    "structural_tag_not_yet": (sp(structural_tag="{}"), ["structural_tag", "cannot be honoured yet"]),
    "regex_unparsable": (sp(regex="[0-9"), ["sampling_params.regex is invalid", "unclosed character class"]),
    "json_schema_not_json": (sp(json_schema="{nope"), ["sampling_params.json_schema is not JSON"]),
    "json_schema_unusable": (sp(json_schema='{"type": "bogus"}'), ["sampling_params.json_schema", "bogus"]),
    "ebnf_unparsable": (sp(ebnf="root ::= ("), ["sampling_params.ebnf"]),
    "two_grammars": (sp(regex="a", ebnf='root ::= "a"'), ["only one of regex, json_schema, ebnf"]),
    "stop_regex_unparsable": (sp(stop_regex="(a"), ["stop_regex", "not a regular expression"]),
    "stop_regex_empty_match": (sp(stop_regex="a*"), ["stop_regex", "at least one character"]),
    "logit_bias_bad_token": (sp(logit_bias={"999999": 1.0}), ["logit_bias", "token ids in [0, 49152)"]),
    "logit_bias_not_an_id": (sp(logit_bias={"abc": 1.0}), ["logit_bias", "token ids"]),
}


def post(client, body: Any):
    if isinstance(body, bytes):
        return client.post("/generate", content=body, headers={"content-type": "application/json"})
    return client.post("/generate", json=body)


def assert_400(r, expected: list[str]) -> str:
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == 400
    for part in expected:
        assert part in err["message"], f"{part!r} not in {err['message']!r}"
    return err["message"]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_400_naming_the_field(client, case):
    body, expected = BAD[case]
    assert_400(post(client, body), expected)


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_400_when_streaming_too(client, stream):
    r = post(client, {**sp(top_p=0), "stream": stream})
    assert_400(r, ["top_p"])


def assert_413(r) -> str:
    """Payload Too Large, in the native error shape, naming the limit (not the 400 of a wrong body)."""
    assert r.status_code == 413, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == 413 and "body" in err["message"]
    assert f"limit of {MAX_BODY_BYTES} bytes" in err["message"], err["message"]
    return err["message"]


def test_body_over_the_size_limit(client):
    assert MAX_BODY_BYTES == 1 << 20
    ids = json.dumps(list(range(100, 100 + 200_000)))  # ~1.4 MB of JSON, 2 MiB padded
    body = ('{"input_ids": ' + ids + "}").encode().ljust(2 << 20)
    assert_413(post(client, body))


def chunks():
    """A chunked upload declares no length; the limit still holds while reading."""
    yield b'{"text": "'
    for _ in range(32):
        yield b"a" * (64 << 10)
    yield b'"}'


def test_body_over_the_size_limit_without_content_length(client):
    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert_413(r)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_openai_bodies_over_the_size_limit_get_openai_413s(client, path):
    for body in (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', chunks()):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and f"limit of {MAX_BODY_BYTES} bytes" in err["message"]


SGLANG_SAMPLING_PARAMS = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
]  # fmt: skip


@pytest.mark.parametrize("name", [n for n in SGLANG_SAMPLING_PARAMS if n != "max_new_tokens"])
def test_each_sglang_sampling_param_may_be_null(client, name):
    out = generate(client, {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, name: None}})
    assert out["meta_info"]["completion_tokens"] == 1


def test_all_sglang_sampling_params_null_at_once(client):
    params = {name: None for name in SGLANG_SAMPLING_PARAMS if name != "structural_tag"}
    out = generate(client, {"text": PROMPT, "sampling_params": {**params, "max_new_tokens": 2}})
    assert out["meta_info"]["completion_tokens"] == 2


def test_null_max_new_tokens_means_the_default(client):
    # greedy, so the chat model ends its short answer with <|im_end|> long before 128 tokens
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    out = generate(client, {"text": chat, "sampling_params": {"max_new_tokens": None, "temperature": 0}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


def test_sglang_request_fields_at_their_defaults_are_accepted(client):
    """What SGLang's own clients send with every request, left at the defaults."""
    body = {
        "text": PROMPT, "sampling_params": greedy(1), "rid": None, "stream": False,
        "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
        "return_text_in_logprobs": False, "image_data": None, "lora_path": None, "log_metrics": True,
        "return_hidden_states": False, "custom_logit_processor": None, "session_params": None,
    }  # fmt: skip
    out = generate(client, body)
    assert out["meta_info"]["completion_tokens"] == 1


def test_still_serving_after_all_that(srv, client):
    out = generate(client, {"text": PROMPT, "sampling_params": greedy(4, ignore_eos=True)})
    assert out["meta_info"]["completion_tokens"] == 4
    assert all(p.poll() is None for p in srv.procs.values())
    assert srv.info()["gateway"]["in_flight"] == 0
