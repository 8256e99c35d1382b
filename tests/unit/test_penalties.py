"""Batched penalties against a plain per-request reference (no model)."""

from __future__ import annotations

import random

import pytest
import torch

from services.scheduler.request import Req
from services.scheduler.sampling.dense_penalties import DensePenaltyProcessor
from services.scheduler.sampling.logit_bias import MAX_BIAS, LogitBiasProcessor
from services.scheduler.sampling.min_new_tokens import MinNewTokensProcessor
from services.scheduler.sampling.penalties import PenaltyProcessor
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams

V, EOS = 50, 2


def make_req(rid: str, row: int, prompt: list[int], output: list[int], **params) -> Req:
    r = Req(
        GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(**params), out_subject="x"), (EOS,)
    )
    r.row, r.output = row, list(output)
    return r


IMPLS = [PenaltyProcessor, DensePenaltyProcessor]


class Penalizer:
    """The three logits processors that change logits, in SampleStep's order (penalties: `impl`)."""

    def __init__(self, rows: int, vocab: int, device: torch.device, impl: type = PenaltyProcessor) -> None:
        self.penalties = impl(rows, vocab, device)
        self.procs = [self.penalties, LogitBiasProcessor(device), MinNewTokensProcessor(device)]

    @property
    def state(self):
        """The penalty state tensor, None until a request used a penalty."""
        p = self.penalties
        return p.out_counts if isinstance(p, PenaltyProcessor) else p.counts

    def on_admit(self, r: Req) -> None:
        for p in self.procs:
            p.admit(r)

    def apply(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        for p in self.procs:
            p.apply(logits, reqs, lens(reqs))

    def on_sample(self, reqs: list[Req], tokens: torch.Tensor) -> None:
        for p in self.procs:
            p.on_sample(reqs, tokens)


def lens(reqs: list[Req]) -> torch.Tensor:
    return torch.tensor([[len(r.output)] for r in reqs], dtype=torch.int64)


def reference(logits: torch.Tensor, r: Req) -> torch.Tensor:
    """One request, one token at a time, straight from the definitions."""
    s, out = r.sampling, logits.clone()
    for t in range(V):
        count = r.output.count(t)
        out[t] -= s.frequency_penalty * count + s.presence_penalty * (count > 0)
        if s.repetition_penalty != 1.0 and (count or t in r.prompt):
            out[t] = out[t] / s.repetition_penalty if out[t] > 0 else out[t] * s.repetition_penalty
    for token, bias in (s.logit_bias or {}).items():
        out[int(token)] += bias
    if len(r.output) < s.min_new_tokens:
        for t in {EOS, *s.stop_token_ids}:
            out[t] = float("-inf")
    return out


@pytest.fixture(params=["whole", "slices"])
def slices(request, monkeypatch):
    """The dense penalties work on a batch at once, or (as past DRAW_SLICE_LOGITS) 2 rows at a time."""
    if request.param == "slices":
        import services.scheduler.sampling.sampler as sampler

        monkeypatch.setattr(sampler, "DRAW_SLICE_LOGITS", 2 * V)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_batch_matches_the_reference_over_several_steps(impl, slices):
    rng = random.Random(0)
    reqs = [
        make_req("plain", 0, [1, 5, 7], []),
        make_req("freq", 1, [3, 4], [], frequency_penalty=0.7),
        make_req("pres", 2, [3, 4], [], presence_penalty=-1.2),
        make_req("rep", 3, [9, 10, 11], [], repetition_penalty=1.6),
        make_req(
            "all",
            4,
            [12, 13],
            [],
            frequency_penalty=1.1,
            presence_penalty=0.5,
            repetition_penalty=0.4,
            min_new_tokens=3,
            stop_token_ids=[7],
            logit_bias={"20": 5.0, "21": -3.0},
        ),  # fmt: skip
        make_req("bias", 5, [1], [], logit_bias={"0": 2.5}),
    ]
    pen = Penalizer(8, V, torch.device("cpu"), impl)
    for r in reqs:
        pen.on_admit(r)
    for _ in range(6):
        logits = torch.randn(len(reqs), V) * 3
        expected = torch.stack([reference(logits[i], r) for i, r in enumerate(reqs)])
        got = logits.clone()
        pen.apply(got, reqs)
        assert torch.allclose(got, expected, atol=1e-5, equal_nan=True)
        tokens = torch.tensor([rng.randrange(V) for _ in reqs])
        pen.on_sample(reqs, tokens)
        for r, t in zip(reqs, tokens.tolist(), strict=True):
            r.output.append(t)


@pytest.mark.parametrize("impl", IMPLS)
def test_readmission_rebuilds_counts_from_the_output_so_far(impl):
    r = make_req("r", 2, [4, 5], [6, 6, 8], frequency_penalty=1.0, repetition_penalty=2.0)
    pen = Penalizer(4, V, torch.device("cpu"), impl)
    pen.on_admit(r)  # e.g. after a retraction: the row is new, the output is not
    logits = torch.randn(1, V)
    got = logits.clone()
    pen.apply(got, [r])
    assert torch.allclose(got[0], reference(logits[0], r), atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_released_and_taken_again_before_the_step_holds_only_the_new_request(impl):
    a = make_req("a", 1, [4, 5, 7], [9, 9], frequency_penalty=1.0, repetition_penalty=2.0)
    b = make_req("b", 1, [11, 12], [13], presence_penalty=0.5, repetition_penalty=3.0)
    c = make_req("c", 3, [20], [], repetition_penalty=1.5)
    pen = Penalizer(4, V, torch.device("cpu"), impl)
    pen.on_admit(a)
    for p in pen.procs:  # a leaves (aborted or retracted) before any step, b takes its row
        p.release(a)
    pen.on_admit(b)
    pen.on_admit(c)
    logits = torch.randn(2, V)
    got = logits.clone()
    pen.apply(got, [b, c])
    for i, r in enumerate((b, c)):
        assert torch.allclose(got[i], reference(logits[i], r), atol=1e-6)


def test_min_new_tokens_mask_lifts_once_reached():
    r = make_req("m", 0, [1], [], min_new_tokens=2, stop_token_ids=[9])
    pen = Penalizer(2, V, torch.device("cpu"))
    pen.on_admit(r)
    for step in range(3):
        got = torch.zeros(1, V)
        pen.apply(got, [r])
        masked = bool(torch.isinf(got[0, EOS])) and bool(torch.isinf(got[0, 9]))
        assert masked == (step < 2)
        r.output.append(30)


@pytest.mark.parametrize("impl", IMPLS)
def test_requests_without_penalties_cost_nothing(impl):
    pen = Penalizer(2, V, torch.device("cpu"), impl)
    r = make_req("p", 0, [1], [])
    pen.on_admit(r)
    logits = torch.randn(1, V)
    got = logits.clone()
    pen.apply(got, [r])
    assert torch.equal(got, logits) and pen.state is None


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_changes_rebuild_the_touched_pairs(impl):
    """A request leaves and another joins between steps: the pairs come back from each row's seen set."""
    rng = random.Random(1)
    a = make_req("a", 0, [1, 2, 3], [], frequency_penalty=0.9, repetition_penalty=1.3)
    b = make_req("b", 1, [4, 5], [], presence_penalty=0.8)
    c = make_req("c", 2, [6], [], repetition_penalty=0.7)
    pen = Penalizer(4, V, torch.device("cpu"), impl)
    for r in (a, b, c):
        pen.on_admit(r)
    for batch in ([a, b], [a, b], [b, c, a], [c, a], [a]):
        logits = torch.randn(len(batch), V) * 3
        expected = torch.stack([reference(logits[i], r) for i, r in enumerate(batch)])
        got = logits.clone()
        pen.apply(got, batch)
        assert torch.allclose(got, expected, atol=1e-5)
        tokens = torch.tensor([rng.randrange(V) for _ in batch])
        pen.on_sample(batch, tokens)
        for r, t in zip(batch, tokens.tolist(), strict=True):
            r.output.append(t)


def test_huge_logit_biases_are_clamped_so_probabilities_stay_finite():
    r = make_req("b", 0, [1], [], logit_bias={"5": 1e308, "6": -1e308, "7": 3.0})
    pen = Penalizer(2, V, torch.device("cpu"))
    pen.on_admit(r)
    logits = torch.randn(1, V)
    got = logits.clone()
    pen.apply(got, [r])
    assert torch.isfinite(got).all()
    assert got[0, 5] == logits[0, 5] + MAX_BIAS and got[0, 6] == logits[0, 6] - MAX_BIAS
    assert torch.isclose(got[0, 7], logits[0, 7] + 3.0)
    probs = torch.softmax(got, dim=-1)
    assert probs[0, 5] == 1.0 and probs[0, 6] == 0.0


def test_apply_that_raises_leaves_the_logits_untouched():
    """SampleStep then retries request by request: nothing may have been applied twice."""
    biased = make_req("b", 0, [1], [], logit_bias={"5": 2.0}, min_new_tokens=1)
    counted = make_req("c", 1, [1], [3], frequency_penalty=1.0)
    pen = Penalizer(2, V, torch.device("cpu"))
    pen.on_admit(biased)
    pen.on_admit(counted)
    del pen.penalties.seen[counted.row]  # its state is gone: building its pairs raises
    logits = torch.randn(2, V)
    got = logits.clone()
    with pytest.raises(KeyError):
        pen.penalties.apply(got, [biased, counted], lens([biased, counted]))
    assert torch.equal(got, logits)
    pen.apply(got[:1], [biased])
    assert got[0, 5] == logits[0, 5] + 2.0 and torch.isinf(got[0, EOS])
