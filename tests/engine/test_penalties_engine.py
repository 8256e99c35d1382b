"""Penalties, min_new_tokens and logit_bias through the whole engine: they act on the requests that ask
for them and leave every other request in the batch untouched."""

from __future__ import annotations

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = ["1, 1, 1, 1, 1, 1,", "The capital of France is", "List three colours:"]
# the chat model answers it in 6 tokens, then <|im_end|> (id 2)
CHAT = "<|im_start|>user\nReply with one word: is water wet?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def plain(engine):
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


def test_penalised_requests_change_and_their_neighbours_do_not(engine, plain):
    params = [{**GREEDY, "frequency_penalty": 1.5, "presence_penalty": 1.0}, GREEDY, GREEDY]
    outs = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
    assert outs[1:] == plain[1:]
    assert outs[0] != plain[0]
    # a strong frequency penalty stops the model repeating the same token over and over
    assert max(outs[0].count(t) for t in set(outs[0])) < max(plain[0].count(t) for t in set(plain[0]))


def test_repetition_penalty_reproduces(engine):
    params = {**GREEDY, "repetition_penalty": 1.5}
    a = engine.generate(PROMPTS[0], params)["output_ids"]
    b = engine.generate(PROMPTS, [params, GREEDY, GREEDY])[0]["output_ids"]
    assert a == b


def test_logit_bias_forces_a_token(engine, plain):
    token = plain[1][3]
    out = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 5, "logit_bias": {str(token): 100.0}})
    assert out["output_ids"] == [token] * 5


def test_min_new_tokens_masks_eos_until_reached(engine):
    short = engine.generate(CHAT, {"temperature": 0, "max_new_tokens": 64})
    n = short["meta_info"]["completion_tokens"]
    assert short["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    longer = engine.generate(CHAT, {"temperature": 0, "max_new_tokens": 64, "min_new_tokens": n + 5})
    assert longer["meta_info"]["completion_tokens"] >= n + 5
    assert 2 not in longer["output_ids"][: n + 5]


def test_retraction_keeps_penalty_state(engine, make_engine):
    params = [{**GREEDY, "frequency_penalty": 1.0, "repetition_penalty": 1.3}] * 3
    roomy = engine.generate(PROMPTS, params)  # the module engine: the prompts come from its cache
    # 26 prompt tokens and 3 x 16 new ones in 48 slots: retracted twice on the way
    tight = make_engine(max_total_tokens=48, new_token_ratio=0.0)
    outs = tight.generate(PROMPTS, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in roomy]
    assert tight.get_stats()["retractions"] > 0
