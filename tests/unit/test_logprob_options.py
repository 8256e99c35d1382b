"""Parsing the logprob fields of GenerateReqInput: per-prompt lists, broadcast scalars, the b64/flat
rule and the combinations that need return_logprob."""

from __future__ import annotations

import pytest

from services.gateway.generate_input import parse_generate_input
from services.gateway.logprob_options import parse_logprob_options


def test_scalars_apply_to_every_prompt_of_a_batch():
    opts = parse_logprob_options(
        {"return_logprob": True, "top_logprobs_num": 2, "return_flat_raw_top_logprobs": True,
         "return_flat_raw_top_logprobs_b64": True, "token_ids_logprob": [5, 6]}, 3
    )  # fmt: skip
    assert len(opts) == 3
    for o in opts:
        assert o.top_k == 2 and o.flat and o.flat_b64 and o.token_ids == [5, 6] and o.start_len == -1


def test_lists_give_one_value_per_prompt():
    opts = parse_logprob_options(
        {"return_logprob": [True, False], "logprob_start_len": [0, None], "token_ids_logprob": [[1], [2, 3]]},
        2,
    )
    assert opts[1] is None
    assert opts[0].start_len == 0 and opts[0].token_ids == [1]
    assert opts[0].request().token_ids == [1]


def test_nothing_asked_is_none_and_defaults_are_accepted():
    body = {
        "return_logprob": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "token_ids_logprob": None,
    }
    assert parse_logprob_options(body, 2) == [None, None]
    assert parse_logprob_options({}, 1) == [None]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"return_logprob": True, "return_flat_raw_top_logprobs_b64": True}, "requires return_flat_raw"),
        ({"top_logprobs_num": 1}, "need(s) return_logprob"),
        ({"return_output_top_logprobs_b64": True}, "return_output_top_logprobs_b64"),
        ({"return_flat_raw_output_top_logprobs": True}, "return_flat_raw_output_top_logprobs need(s)"),
        ({"return_logprob": True, "top_logprobs_num": 5000}, "[0, 1024]"),
        ({"return_logprob": True, "top_logprobs_num": True}, "top_logprobs_num"),
        ({"return_logprob": True, "logprob_start_len": 1.5}, "logprob_start_len"),
        ({"return_logprob": True, "token_ids_logprob": ["a"]}, "integer token ids"),
        ({"return_logprob": True, "token_ids_logprob": [[1], [2], [3]]}, "one per prompt"),
        ({"return_logprob": [True, True, True]}, "one per prompt"),
        ({"return_logprob": 1}, "true or false"),
    ],
)
def test_bad_combinations_name_the_field(body, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_logprob_options(body, 2)


def test_n_makes_the_response_a_list_and_must_agree_across_a_batch():
    assert parse_generate_input({"text": "a", "sampling_params": {"n": 2}}).is_batch
    assert not parse_generate_input({"text": "a"}).is_batch
    with pytest.raises(ValueError, match="sampling_params.n"):
        parse_generate_input({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]})


def test_flat_output_top_logprobs_and_b64_on_each_flat_side():
    ask = {"return_logprob": True, "top_logprobs_num": 2}
    (o,) = parse_logprob_options({**ask, "return_flat_raw_output_top_logprobs": True}, 1)
    assert o.output_flat and not o.output_b64 and not o.flat
    b64 = {"return_flat_raw_top_logprobs_b64": True}
    (o,) = parse_logprob_options({**ask, **b64, "return_flat_raw_output_top_logprobs": True}, 1)
    assert o.output_flat and o.output_b64 and not o.flat and not o.flat_b64
    (o,) = parse_logprob_options({**ask, **b64, "return_flat_raw_top_logprobs": True}, 1)
    assert o.flat and o.flat_b64 and not o.output_flat and not o.output_b64
    (o,) = parse_logprob_options({**ask, "return_output_top_logprobs_b64": True}, 1)  # beyond SGLang
    assert o.output_flat and o.output_b64 and not o.flat


def test_flat_output_top_logprobs_are_for_a_finished_response_only():
    body = {
        "text": "a",
        "return_logprob": True,
        "top_logprobs_num": 1,
        "return_flat_raw_output_top_logprobs": True,
    }
    assert parse_generate_input(body).prompts[0].logprob.output_flat
    with pytest.raises(ValueError, match="return_flat_raw_output_top_logprobs .* does not support stream"):
        parse_generate_input({**body, "stream": True})
    streamed = {"text": "a", "return_logprob": True, "top_logprobs_num": 1, "stream": True}
    assert parse_generate_input({**streamed, "return_output_top_logprobs_b64": True}).stream
