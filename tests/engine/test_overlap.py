"""Overlap scheduling (the next step launched before the previous one's tokens are processed) gives
exactly what the synchronous loop gives: greedy and seeded tokens, penalties, logprobs, stop ids, EOS
inside the batch, n > 1, chunked prefill, retraction in a tiny pool; and leaks no KV. On CPU it is off
by default, so it is forced on here (`disable_overlap_schedule=False`)."""

from __future__ import annotations

import pytest

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    # ends with EOS (its 6th token) while the others still decode
    "<|im_start|>user\nReply with one word: is water wet?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    # draws nothing: reads the next token's top logprobs (max_new_tokens 0), chunked prefill included
    "The first letter of the alphabet is",
]
PARAMS = [
    {"temperature": 0, "max_new_tokens": 12},
    {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 7, "max_new_tokens": 12, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 16},
    {"temperature": 0, "max_new_tokens": 12, "frequency_penalty": 0.8, "presence_penalty": 0.4,
     "repetition_penalty": 1.3, "min_new_tokens": 4},
    {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [28], "ignore_eos": True},
    {"max_new_tokens": 0},
]  # fmt: skip


def run(engine, params=PARAMS):
    outs = engine.generate(PROMPTS, params, return_logprob=True, top_logprobs_num=2, logprob_start_len=2)
    seeded_n = {"temperature": 1.0, "sampling_seed": 3, "n": 3, "max_new_tokens": 8}
    many = engine.generate("Pick a number:", seeded_n)
    return outs, many


def close(a: list, b: list) -> bool:
    """Logprobs of the same tokens: batches of another composition round differently (~1e-6)."""
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or abs(x - y) < 1e-4)
                                    for x, y in zip(a, b, strict=True))  # fmt: skip


def check_same(got, ref) -> None:
    for g, r in zip(got, ref, strict=True):
        assert g["output_ids"] == r["output_ids"]
        assert g["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert close([e[0] for e in g["meta_info"][key]], [e[0] for e in r["meta_info"][key]])
        tops = g["meta_info"]["output_top_logprobs"], r["meta_info"]["output_top_logprobs"]
        assert [[e[1] for e in row] for row in tops[0]] == [[e[1] for e in row] for row in tops[1]]
        assert close([e[0] for row in tops[0] for e in row], [e[0] for row in tops[1] for e in row])


@pytest.mark.parametrize("options", [{}, {"chunked_prefill_size": 5}])
def test_overlap_matches_the_synchronous_loop(make_engine, options):
    sync_outs, sync_many = run(make_engine(disable_overlap_schedule=True, **options))
    outs, many = run(make_engine(disable_overlap_schedule=False, **options))
    check_same(outs, sync_outs)
    assert [o["output_ids"] for o in many] == [o["output_ids"] for o in sync_many]
    assert outs[2]["meta_info"]["finish_reason"]["type"] == "stop"  # an EOS mid-batch was exercised
    assert outs[5]["output_ids"] == [] and len(outs[5]["meta_info"]["output_top_logprobs"]) == 1


def test_overlap_retracts_in_a_tiny_pool(make_engine):
    """Retraction needs every token known: the step in flight is completed first."""
    long = [{**p, "max_new_tokens": 16, "ignore_eos": True} if p["max_new_tokens"] else p
            for p in PARAMS]  # 80 output tokens beside 60 prompt tokens  # fmt: skip
    results = []
    for disable in (True, False):
        engine = make_engine(disable_overlap_schedule=disable, max_total_tokens=100, new_token_ratio=0.0)
        results.append(run(engine, long)[0])
        assert engine.get_stats()["retractions"] > 0
    check_same(results[1], results[0])


def test_every_decode_step_is_launched_while_the_previous_one_runs(make_engine):
    """The pipeline does not stall: each step after the first is launched before the previous one's
    tokens are processed (completing a step leaves its requests' next token, already launched,
    pending), and each request decodes in every step."""
    engine = make_engine(disable_overlap_schedule=False)
    engine.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    stats = engine.get_stats()
    assert stats["steps"] == 12 and stats["overlapped_steps"] == 11
