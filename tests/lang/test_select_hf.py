"""`select` on the Engine scores choices with the same logprobs HF transformers computes from the same
weights (fp32), and picks what those numbers say for each of the three methods."""

from __future__ import annotations

import pytest
import torch

import sglbus as sgl
from sglbus.lang.choices import greedy_matrix, greedy_pick, mean_logprob

pytestmark = pytest.mark.slow
TOL = 1e-3
PROMPT = "Q: What color is the sky on a clear day?\nA: It is"
CHOICES = [" blue", " green", " bright blue", " purple"]


def hf_row(hf_model, tokenizer, text: str, start: int) -> list[tuple[float | None, int]]:
    ids = tokenizer.encode(text)
    with torch.inference_mode():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [(None if p == 0 else logp[p - 1, ids[p]].item(), ids[p]) for p in range(start, len(ids))]


@pytest.mark.parametrize(
    "method",
    [sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized],
)
def test_select_scores_match_hf(backend, engine, hf_model, method):
    @sgl.function
    def pick(s):
        s += PROMPT + sgl.select("color", choices=CHOICES, choices_method=method)

    state = pick.run()
    assert state.error() is None, state.error()
    meta = state.get_meta_info("color")
    tok = engine.tokenizer
    start = len(tok.encode(PROMPT)) - 2
    ours = meta["input_token_logprobs"]
    ref_means = []
    for choice, row in zip(CHOICES, ours, strict=True):
        ref = hf_row(hf_model, tok, PROMPT + choice, start)
        ref = ref[len(ref) - len(row) :]  # the prompt token the method trims, if it did
        assert [t[1] for t in row] == [r[1] for r in ref]
        for got, (want, _) in zip(row, ref, strict=True):
            assert got[0] == pytest.approx(want, abs=TOL)
        ref_means.append(mean_logprob([[lp, i, None] for lp, i in ref]))
    assert meta["normalized_prompt_logprobs"] == pytest.approx(ref_means, abs=TOL)
    if method is sgl.token_length_normalized:
        assert state["color"] == CHOICES[max(range(len(CHOICES)), key=ref_means.__getitem__)]
    if method is sgl.greedy_token_selection:
        refs = [
            hf_row(hf_model, tok, PROMPT + c, start)[-len(r) :] for c, r in zip(CHOICES, ours, strict=True)
        ]
        assert (
            state["color"]
            == CHOICES[greedy_pick(greedy_matrix([[[lp, i, None] for lp, i in r] for r in refs]))]
        )
    if method is sgl.unconditional_likelihood_normalized:
        scores = []
        for row, uncond in zip(ours, meta["unconditional_token_logprobs"], strict=True):
            ids = [t[1] for t in row]
            with torch.inference_mode():
                logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
            ref_u = [0.0] + [logp[p - 1, ids[p]].item() for p in range(1, len(ids))]
            assert [u[0] or 0.0 for u in uncond] == pytest.approx(ref_u, abs=TOL)
            scores.append(sum(c[0] - u for c, u in zip(row, ref_u, strict=True)) / len(ids))
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(scores, abs=TOL)
        assert state["color"] == CHOICES[max(range(len(CHOICES)), key=scores.__getitem__)]
    assert state.text() == PROMPT + state["color"]
