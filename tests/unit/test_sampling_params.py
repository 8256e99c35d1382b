"""SamplingParams' checks: every field refuses NaN and out-of-range values with a message naming it;
the prompt and an explicit max_new_tokens are checked against the context as SGLang does."""

from __future__ import annotations

import math

import pytest

from shared.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams

VOCAB = 100

BAD = {
    "temperature": [math.nan, math.inf, -0.5],
    "top_p": [math.nan, 0.0, 1.5],
    "min_p": [math.nan, -0.1, 1.5],
    "frequency_penalty": [math.nan, math.inf, 2.5],
    "presence_penalty": [math.nan, -math.inf, -2.5],
    "repetition_penalty": [math.nan, 0.0, 2.5],
    "top_k": [0, -2],
    "max_new_tokens": [-1, 1 << 63],
    "sampling_seed": [1 << 64, -(1 << 63) - 1],
    "n": [0],
}


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in BAD.items() for v in vs])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"sampling_params.{field} = "):
        SamplingParams(**{field: value}).verify(VOCAB)


@pytest.mark.parametrize("seed", [0, -(1 << 63), (1 << 63), (1 << 64) - 1])
def test_seeds_up_to_what_the_bus_carries_are_accepted(seed):
    SamplingParams(sampling_seed=seed).verify(VOCAB)


@pytest.mark.parametrize(
    ("bias", "message"),
    [({"²": 1.0}, "logit_bias key"), ({"--5": 1.0}, "logit_bias key"), ({"5": math.nan}, "finite")],
)
def test_logit_bias_keys_and_values(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias).verify(VOCAB)


def test_explicit_max_new_tokens_must_fit_the_context_and_the_default_is_cut_to_it():
    SamplingParams(max_new_tokens=20).verify_length(80, 100)  # exactly full is fine
    with pytest.raises(ValueError) as e:
        SamplingParams(max_new_tokens=21).verify_length(80, 100)
    msg = str(e.value)
    assert "maximum context length of 100 tokens" in msg and "a total of 101 tokens" in msg
    assert "80 tokens from the input" in msg and "21 tokens for the completion" in msg
    with pytest.raises(ValueError, match="the prompt has 100 tokens; at most 99 fit the context length"):
        SamplingParams().verify_length(100, 100)
    default = SamplingParams()
    default.verify_length(99, 100)  # only an explicit max_new_tokens is checked (SGLang)
    assert default.max_new_tokens_for(99, 100) == 1
    assert default.max_new_tokens_for(10, 1000) == DEFAULT_MAX_NEW_TOKENS
    assert SamplingParams(max_new_tokens=7).max_new_tokens_for(10, 1000) == 7
    assert SamplingParams.from_dict({"max_new_tokens": None}).max_new_tokens is None
