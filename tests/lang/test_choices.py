"""The three choice methods on given logprob rows (no model)."""

from __future__ import annotations

import pytest

import sglbus as sgl
from sglbus.lang.choices import greedy_matrix, mean_logprob, trim_prompt_token, unconditional_score


def row(*logprobs, texts=None):
    texts = texts or [f"t{i}" for i in range(len(logprobs))]
    return [[lp, i, t] for i, (lp, t) in enumerate(zip(logprobs, texts, strict=True))]


def call(method, rows, uncond=None):
    return method(
        choices=[f"c{i}" for i in range(len(rows))],
        normalized_prompt_logprobs=[mean_logprob(r) for r in rows],
        input_token_logprobs=rows,
        output_token_logprobs=[[] for _ in rows],
        unconditional_token_logprobs=uncond,
    )


def test_mean_skips_the_unknown_first_logprob():
    assert mean_logprob(row(None, -1.0, -3.0)) == pytest.approx(-2.0)
    assert mean_logprob([]) == float("-inf")


def test_token_length_normalized_prefers_the_best_mean():
    rows = [row(-1.0, -1.0, -1.0, -1.0), row(-0.5, -2.0)]  # sums -4 vs -2.5; means -1 vs -1.25
    d = call(sgl.token_length_normalized, rows)
    assert d.decision == "c0"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -1.25])


def test_greedy_goes_token_by_token_and_pads_with_the_mean():
    rows = [row(-0.1, -5.0), row(-0.2, -0.1, -0.1)]
    assert greedy_matrix(rows)[0] == pytest.approx([-0.1, -5.0, -2.55])
    d = call(sgl.greedy_token_selection, rows)
    assert d.decision == "c0"  # best at the first token, whatever follows
    assert call(sgl.token_length_normalized, rows).decision == "c1"  # where the mean disagrees
    tie = [row(-0.1, -0.9), row(-0.1, -0.3)]
    assert call(sgl.greedy_token_selection, tie).decision == "c1"  # a tie moves on to the next token


def test_unconditional_subtracts_the_prior():
    cond = [row(-1.0, -1.0), row(-2.0, -2.0)]
    uncond = [row(None, -0.5), row(None, -4.0)]  # c1 is unlikely anyway: the question helps it more
    assert unconditional_score(cond[0], uncond[0]) == pytest.approx((-1.0 + -0.5) / 2)
    d = call(sgl.unconditional_likelihood_normalized, cond, uncond)
    assert d.decision == "c1"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.75, 0.0])
    assert call(sgl.token_length_normalized, cond).decision == "c0"
    with pytest.raises(ValueError, match="unconditional_token_logprobs"):
        call(sgl.unconditional_likelihood_normalized, cond)
    with pytest.raises(ValueError, match="2 conditional logprobs but 1"):
        unconditional_score(cond[0], row(None))


def test_the_prompt_token_is_trimmed_only_when_it_ends_the_prompt():
    r = row(-0.1, -0.2, -3.0, texts=["A", ":", " yes"])
    assert trim_prompt_token("Q?\nA:", r) == r  # 'A' is not where the prompt ends
    assert trim_prompt_token("Q? A", r) == r[1:]
    assert trim_prompt_token("Q? A", r[:1]) == r[:1]  # never to nothing
