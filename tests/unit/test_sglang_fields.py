"""SGLang's request schema (shared/sglang_fields.py): every field of GenerateReqInput and every sampling
parameter is accepted at its default, one we cannot honour is refused by name when set, and the bodies
SGLang's own benchmark client sends pass."""

from __future__ import annotations

import time
from typing import Any

import pytest

from services.gateway import sglang_shape
from services.gateway.generate_input import NOT_YET, SUPPORTED, parse_generate_input
from services.gateway.request_state import RequestState
from shared.sampling_params import SamplingParams
from shared.sglang_fields import GENERATE_REQ_INPUT, SAMPLING_PARAMS, SGLANG_VERSION

VOCAB = 1000
SAMPLING_NOT_YET = [k for k in SAMPLING_PARAMS if k not in SamplingParams.__struct_fields__]


def accepted(body: dict[str, Any]) -> list[SamplingParams]:
    """The prompts' sampling parameters, after every check the gateway runs on them."""
    req = parse_generate_input(body)
    for p in req.prompts:
        p.sampling.verify(VOCAB)
        assert p.sampling.unsupported() == []
    return [p.sampling for p in req.prompts]


def other_than(default: Any) -> Any:
    """A value that is not the default (nor null)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    return "set"


def test_the_schema_is_sglangs_and_every_name_is_accepted():
    assert SGLANG_VERSION == "0.5.23"
    assert len(GENERATE_REQ_INPUT) == 72 and len(SAMPLING_PARAMS) == 33
    assert set(SUPPORTED) | set(NOT_YET) == set(GENERATE_REQ_INPUT) | {"return_output_top_logprobs_b64"}
    assert set(SamplingParams.__struct_fields__) <= set(SAMPLING_PARAMS)


@pytest.mark.parametrize("field", list(GENERATE_REQ_INPUT))
def test_every_request_field_at_its_default_is_accepted(field):
    body = {"input_ids": [1, 2]} if field == "text" else {"text": "hi"}
    accepted({**body, field: GENERATE_REQ_INPUT[field]})


@pytest.mark.parametrize("field", list(SAMPLING_PARAMS))
def test_every_sampling_parameter_at_its_default_is_accepted(field):
    accepted({"text": "hi", "sampling_params": {field: SAMPLING_PARAMS[field]}})
    accepted({"text": "hi", "sampling_params": {field: None}})


def test_every_field_at_its_default_at_once_is_accepted():
    body = {**GENERATE_REQ_INPUT, "text": "hi", "sampling_params": dict(SAMPLING_PARAMS)}
    (sp,) = accepted(body)
    assert sp.max_new_tokens == 128 and sp.temperature == 1.0 and not sp.is_greedy


@pytest.mark.parametrize("field", list(NOT_YET))
def test_a_request_field_we_cannot_honour_is_refused_by_name(field):
    value = other_than(NOT_YET[field])
    with pytest.raises(ValueError, match=rf"^{field} is not supported yet by this server; leave it unset$"):
        parse_generate_input({"text": "hi", field: value})
    with pytest.raises(ValueError, match=rf"^{field} is not supported yet"):  # one prompt of a batch
        parse_generate_input({"text": ["a", "b"], field: [None, value]})


def test_several_fields_we_cannot_honour_are_named_together():
    with pytest.raises(ValueError, match="^return_routed_experts, cache_salt are not supported yet .* them"):
        parse_generate_input({"text": "hi", "cache_salt": "s", "return_routed_experts": True})


@pytest.mark.parametrize("field", SAMPLING_NOT_YET)
def test_a_sampling_parameter_we_cannot_honour_is_refused_by_name(field):
    with pytest.raises(ValueError, match=rf"^sampling parameter\(s\) {field} cannot be honoured yet"):
        parse_generate_input({"text": "hi", "sampling_params": {field: other_than(SAMPLING_PARAMS[field])}})


def test_structural_tag_is_parsed_but_not_honoured_yet():
    body = {"text": "hi", "sampling_params": {"structural_tag": '{"type": "x"}'}}
    assert parse_generate_input(body).prompts[0].sampling.unsupported() == ["structural_tag"]


def test_names_outside_sglangs_schema_are_refused():
    with pytest.raises(ValueError, match=rf"unknown field\(s\) 'colour'; fields \(SGLang {SGLANG_VERSION}'s"):
        parse_generate_input({"text": "hi", "colour": None})
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) 'colour'"):
        parse_generate_input({"text": "hi", "sampling_params": {"colour": None}})


# What `python -m sglang.benchmark.serving --backend sglang` of SGLang 0.5.23 sends to /generate
# (python/sglang/benchmark/serving.py, async_request_sglang_generate): the warm-up request and every
# run's are built the same way; lora_path is None without --lora-name, and image_data, top_logprobs_num
# and token_ids_logprob are added only when a dataset or flag asks for them.
BENCH_DEFAULT = {  # default flags: --temperature 0.0, ignore_eos, streaming, no logprobs
    "text": "Hello, my name is",
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True},
    "stream": True,
    "lora_path": None,
    "return_logprob": False,
    "return_routed_experts": False,
    "logprob_start_len": -1,
}
BENCH_TOKENIZED = {  # --tokenize-prompt --disable-stream --disable-ignore-eos --top-p 0.9
    "input_ids": [9906, 11, 856, 836, 374],
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": False, "top_p": 0.9},
    "stream": False,
    "lora_path": None,
    "return_logprob": False,
    "return_routed_experts": False,
    "logprob_start_len": -1,
}
BENCH_LOGPROBS = {  # --return-logprob --logprob-start-len 0 --top-logprobs-num 3 --token-ids-logprob 1 2
    "text": "Hello, my name is",
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True},
    "stream": True,
    "lora_path": None,
    "return_logprob": True,
    "return_routed_experts": False,
    "logprob_start_len": 0,
    "top_logprobs_num": 3,
    "token_ids_logprob": [1, 2],
}


@pytest.mark.parametrize("body", [BENCH_DEFAULT, BENCH_TOKENIZED, BENCH_LOGPROBS])
def test_sglang_0_5_23_benchmark_client_bodies_are_accepted(body):
    (sp,) = accepted(body)
    assert sp.max_new_tokens == body["sampling_params"]["max_new_tokens"] and sp.is_greedy
    assert parse_generate_input(body).stream == body["stream"]


def test_the_benchmark_client_asking_for_routed_experts_is_refused_by_name():
    with pytest.raises(ValueError, match="^return_routed_experts is not supported yet"):
        parse_generate_input({**BENCH_DEFAULT, "return_routed_experts": True})


def test_return_prompt_token_ids_puts_the_prompt_in_every_response():
    (p,) = parse_generate_input({"input_ids": [5, 6, 7], "return_prompt_token_ids": True}).prompts
    assert p.return_prompt_ids
    assert (
        not parse_generate_input({"text": "hi", "return_prompt_token_ids": False})
        .prompts[0]
        .return_prompt_ids
    )
    st = RequestState("r", 3, time.time(), prompt_ids=[5, 6, 7])
    assert sglang_shape.response(st)["prompt_token_ids"] == [5, 6, 7]
    assert "prompt_token_ids" not in sglang_shape.response(RequestState("r", 3, time.time()))
    with pytest.raises(ValueError, match="return_prompt_token_ids must be true or false"):
        parse_generate_input({"text": "hi", "return_prompt_token_ids": 1})
