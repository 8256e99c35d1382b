"""Fuzzing the request parser: whatever a client sends, `parse_generate_input` and `verify` either
accept it or raise ValueError with a message (the gateway's 400) — never another exception, which
would be a 500."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.generate_input import MAX_N, NOT_YET, SUPPORTED, decode_json, parse_generate_input
from shared.sampling_params import SamplingParams
from shared.sglang_fields import SAMPLING_PARAMS

VOCAB_SIZE = 49152
FUZZ = settings(max_examples=300, deadline=None, database=None)

EDGE_INTS = [
    0, 1, -1, 2, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31,
    2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1,
]  # fmt: skip
EDGE_FLOATS = [0.0, -0.0, 1e-7, 0.5, 1.0, 2.0, 2.5, -2.5, 1e308, math.nan, math.inf, -math.inf]
EDGE_TEXT = ["", "0", "-0", "5", "-5", "--5", "49152", "1e3", "nan", "²", "٣", "a", " 1", "<|im_end|>"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EDGE_FLOATS),
    st.text(max_size=12),
    st.sampled_from(EDGE_TEXT),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
# values shaped like what the fields expect, at and beyond their edges
wild = st.one_of(
    json_values,
    st.lists(st.sampled_from(EDGE_INTS) | st.integers(-3, VOCAB_SIZE + 3), max_size=4),
    st.lists(st.sampled_from(EDGE_TEXT), max_size=3),
    st.dictionaries(st.sampled_from(EDGE_TEXT), st.sampled_from(EDGE_FLOATS) | st.integers(), max_size=3),
)

ints = st.sampled_from(EDGE_INTS) | st.integers(-3, 300)
floats = st.sampled_from(EDGE_FLOATS) | st.floats(-3, 3)
id_lists = st.lists(st.sampled_from(EDGE_INTS) | st.integers(-3, VOCAB_SIZE + 3), max_size=4)
texts = st.sampled_from(EDGE_TEXT) | st.text(max_size=8)


@st.composite
def some_fields(draw: st.DrawFn, values: dict[str, st.SearchStrategy[Any]], max_size: int) -> dict[str, Any]:
    """A few of the fields, each with a value of its type (often at an edge) or null; now and then one
    of them with any value at all."""
    keys = draw(st.lists(st.sampled_from(sorted(values)), unique=True, max_size=max_size))
    out = {k: draw(values[k] | st.none()) for k in keys}
    if draw(st.integers(0, 3)) == 0:
        out[draw(st.sampled_from(sorted(values)))] = draw(wild)
    return out


SAMPLING_VALUES: dict[str, st.SearchStrategy[Any]] = {
    **dict.fromkeys(
        ["max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed", "stream_interval"], ints
    ),
    **dict.fromkeys(
        ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"],
        floats | ints,
    ),
    **dict.fromkeys(
        ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"], st.booleans()
    ),
    **dict.fromkeys(["stop", "stop_regex"], texts | st.lists(texts, max_size=3)),
    "stop_token_ids": ints | id_lists,
    **dict.fromkeys(["regex", "json_schema", "ebnf", "structural_tag"], texts),
    "logit_bias": st.dictionaries(texts | ints.map(str), floats | ints, max_size=3),
    "custom_params": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    # SGLang's parameters not honoured yet: their defaults (accepted) or anything (refused)
    **{k: st.just(v) for k, v in SAMPLING_PARAMS.items() if k not in SamplingParams.__struct_fields__},
}
assert set(SAMPLING_VALUES) == set(SAMPLING_PARAMS), "a new sampling parameter: fuzz it too"
sampling = some_fields(SAMPLING_VALUES, 8)


def per_prompt(typed: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return typed | st.lists(typed | st.none(), max_size=3)


REQ_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "rid": per_prompt(texts),
    "stream": st.booleans(),
    "log_metrics": st.booleans(),
    "return_logprob": per_prompt(st.booleans()),
    "logprob_start_len": per_prompt(ints),
    "top_logprobs_num": per_prompt(ints),
    "token_ids_logprob": id_lists | st.lists(id_lists | st.none(), max_size=3),
    **dict.fromkeys(
        [
            "return_text_in_logprobs",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs",
            "return_flat_raw_top_logprobs_b64",
            "return_output_top_logprobs_b64",
            "return_prompt_token_ids",
            "require_reasoning",
        ],
        st.booleans(),
    ),
    "data_parallel_rank": ints | st.none(),
    "image_data": per_prompt(texts | st.lists(texts, max_size=2)),  # an image, or a list, per prompt
    # fields not honoured yet: their defaults (accepted) or anything (refused)
    **{k: st.just(v) | st.lists(st.just(v), max_size=2) for k, v in NOT_YET.items()},
}
assert set(REQ_VALUES) | {"text", "input_ids", "sampling_params"} == set(SUPPORTED) | set(NOT_YET)
request_fields = some_fields(REQ_VALUES, 5)
prompts = st.one_of(
    st.fixed_dictionaries({"text": texts}),
    st.fixed_dictionaries({"text": st.lists(texts, max_size=3)}),
    st.fixed_dictionaries({"input_ids": id_lists}),
    st.fixed_dictionaries({"input_ids": id_lists.filter(bool)}),
    st.fixed_dictionaries({"input_ids": st.lists(id_lists, max_size=3)}),
    st.fixed_dictionaries({"text": texts | st.none(), "input_ids": id_lists | st.none()}),
    st.fixed_dictionaries({}, optional={"text": wild, "input_ids": wild}),
)


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A prompt, some request fields (often at the edges of what they allow) and sampling_params:
    one object, one per prompt, or something else."""
    obj = {**draw(prompts), **draw(request_fields)}
    obj["sampling_params"] = draw(st.one_of(sampling, sampling, st.lists(sampling, max_size=3), wild))
    return obj


def check(obj: Any) -> None:
    try:
        req = parse_generate_input(obj)
    except ValueError as e:
        assert str(e), f"empty ValueError for {obj!r}"
        return
    assert req.prompts
    for p in req.prompts:
        assert p.sampling.n <= MAX_N, (
            "n samples are n requests: an accepted body must not fan out without end"
        )
        try:
            p.sampling.verify(VOCAB_SIZE)
        except ValueError as e:
            assert str(e), f"empty ValueError for {obj!r}"


@FUZZ
@given(json_values)
def test_any_json_value_is_accepted_or_a_value_error(obj):
    check(obj)


@FUZZ
@given(near_valid())
def test_near_valid_requests_are_accepted_or_a_value_error(obj):
    check(obj)


@FUZZ
@given(sampling)
def test_any_sampling_params_are_accepted_or_a_value_error(sp):
    """A valid prompt, so every draw reaches `verify`."""
    check({"text": "hi", "sampling_params": sp})


@FUZZ
@given(st.binary(max_size=64) | near_valid().map(lambda o: json.dumps(o).encode()) | st.sampled_from(
    [b"[" * 5000, b'{"text": "\\ud800"}', b"NaN", b'{"input_ids": [18446744073709551616]}', b"\xff"]
))  # fmt: skip
def test_any_body_is_accepted_or_a_value_error(body):
    """What the HTTP and bus APIs do with a body: JSON first, then the request."""
    try:
        obj = decode_json(body)
    except ValueError as e:
        assert str(e)
        return
    check(obj)


def test_n_above_the_limit_is_refused_naming_the_field():
    assert (
        parse_generate_input({"text": "hi", "sampling_params": {"n": MAX_N}}).prompts[0].sampling.n == MAX_N
    )
    with pytest.raises(ValueError, match=rf"sampling_params\.n = {MAX_N + 1} .*\[1, {MAX_N}\]"):
        parse_generate_input({"text": "hi", "sampling_params": {"n": MAX_N + 1}})


@pytest.mark.parametrize("bad", [True, 1.0, None, "7", [7], 2**70 * 1.0])
def test_input_ids_take_ints_only(bad):
    with pytest.raises(ValueError, match="integers only"):
        parse_generate_input({"input_ids": [5, bad, 6]})
    with pytest.raises(ValueError, match="integers only"):
        parse_generate_input({"input_ids": [[5, 6], [bad]]})
    assert parse_generate_input({"input_ids": [[5, 6], [2**40]]}).prompts[1].input_ids == [2**40]
