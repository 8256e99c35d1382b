"""One request cannot fail or hold up the others: the issue's failing requests beside a normal one, a
NaN temperature that skips the gateway, unbounded max_new_tokens, and a long output that must not
keep short requests queued past max_queue_wait."""

from __future__ import annotations

import math

import pytest
from bus_probe import BusProbe

from shared.finish import as_dict
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SEED_2_63 = {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 1 << 63}
HUGE_BIAS = {"temperature": 1.0, "max_new_tokens": 4, "logit_bias": {"5": 1e308}}


@pytest.fixture(scope="module")
def alone(engine):
    return engine.generate(PROMPT, GREEDY)["output_ids"]


def test_the_issues_failing_requests_work_and_leave_their_batch_alone(engine, alone):
    outs = engine.generate(["Hello", "Hello", PROMPT], [SEED_2_63, HUGE_BIAS, GREEDY])
    assert outs[2]["output_ids"] == alone
    # seeds are taken mod 2^63, as the gateway derives n > 1 seeds: 2^63 draws as seed 0 does
    seed_0 = engine.generate("Hello", {**SEED_2_63, "sampling_seed": 0})
    assert outs[0]["output_ids"] == seed_0["output_ids"] and len(seed_0["output_ids"]) == 4
    # a bias of 1e308 is clamped, not inf: it still forces its token, with finite probabilities
    assert outs[1]["output_ids"] == [5] * 4
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for o in outs[:2])


def test_unbounded_max_new_tokens_is_a_400_naming_both_numbers(engine):
    with pytest.raises(ValueError, match=r"max_new_tokens = 9223372036854775808 .*>= 0 and < 2\^63"):
        engine.generate(PROMPT, {"max_new_tokens": 1 << 63})
    with pytest.raises(
        ValueError, match="context length of 8192 tokens.*1000000000 tokens for the completion"
    ):
        engine.generate(PROMPT, {"max_new_tokens": 10**9, "ignore_eos": True})


def test_a_nan_temperature_straight_off_the_bus_is_refused_alone(engine, alone):
    """What an anonymous client on the bus could publish: the scheduler checks it again."""
    ids = engine.tokenizer.encode(PROMPT)
    bad = GenerateReq(rid="nan-temp", input_ids=ids, out_subject="sglbus.out.fault-isolation-test",
                      sampling=SamplingParams(temperature=math.nan, max_new_tokens=4))  # fmt: skip
    with BusProbe(engine, bad.out_subject) as probe:
        probe.send(bad)
        assert engine.generate(PROMPT, GREEDY)["output_ids"] == alone
        out = probe.final(timeout=30)
    assert out.rid == "nan-temp" and out.finished and out.output_ids == []
    reason = as_dict(out.finish)
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "sampling_params.temperature = nan" in reason["message"]


def test_a_long_output_does_not_keep_a_short_request_queued(make_engine):
    # a reserve of 0.4 * 4000 output tokens exceeds the whole pool: the short request fits beside the
    # long one, but only the max_queue_wait bound lets it in while the long one runs
    engine = make_engine(max_total_tokens=1000, max_queue_wait=0.5)
    long = engine.generate(
        PROMPT, {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}, stream=True
    )
    try:
        next(long)
        short = engine.generate("Hi", {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
        assert engine.get_stats()["running"] == 1  # the long request is still generating
        assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    finally:
        long.close()
