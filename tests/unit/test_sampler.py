"""The batched sampler against the distributions it must draw from (no model)."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.sampling.sampler import SamplingInfo, sample
from shared.sampling_params import SamplingParams

V = 8


def draw(logits: torch.Tensor, params: list[SamplingParams], n: int) -> torch.Tensor:
    """n draws per row -> counts [B, V]."""
    info = SamplingInfo.build(params, V, logits.device)
    counts = torch.zeros(len(params), V)
    for i in range(n):
        ids = sample(logits, info, torch.full((len(params), 1), i))
        counts[torch.arange(len(params)), ids] += 1
    return counts


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(top_k=1)]
    counts = draw(logits, params, 200)
    assert counts[0, logits[0].argmax()] == 200
    assert counts[2, logits[2].argmax()] == 200
    assert (counts[1] > 0).sum() > 1  # the sampled row really samples


def test_top_k_top_p_min_p_keep_only_allowed_tokens():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0]] * 3) + 1e-9)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(min_p=0.3)]
    counts = draw(logits, params, 400)
    assert set(counts[0].nonzero().flatten().tolist()) == {0, 1}
    # top_p 0.75: 0.4 + 0.3 = 0.7 < 0.75, so token 2 is still needed
    assert set(counts[1].nonzero().flatten().tolist()) == {0, 1, 2}
    # min_p 0.3: keep p >= 0.3 * 0.4 = 0.12
    assert set(counts[2].nonzero().flatten().tolist()) == {0, 1, 2}


def test_frequencies_follow_temperature_scaled_distribution():
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9, -9, -9, -9]])
    for temp in (0.5, 1.0, 2.0):
        counts = draw(logits, [SamplingParams(temperature=temp)], 4000)
        expected = torch.softmax(logits / temp, dim=-1)
        assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_seeded_rows_reproduce_regardless_of_batch_and_follow_the_distribution():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, -4.0]])
    seeded = SamplingParams(temperature=1.0, sampling_seed=1234)
    pos = torch.arange(64).unsqueeze(1)
    a = sample(logits.expand(64, V), SamplingInfo.build([seeded] * 64, V, "cpu"), pos)
    # same seed and positions, different batch neighbours -> same tokens
    mixed = [seeded if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(64)]
    b = sample(logits.expand(64, V), SamplingInfo.build(mixed, V, "cpu"), pos)
    assert torch.equal(a[::2], b[::2])
    other = SamplingInfo.build([SamplingParams(sampling_seed=99)] * 64, V, "cpu")
    assert not torch.equal(a, sample(logits.expand(64, V), other, pos))
    many = sample(
        logits.expand(4000, V), SamplingInfo.build([seeded] * 4000, V, "cpu"), torch.arange(4000)[:, None]
    )
    freq = torch.bincount(many, minlength=V).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)


def test_any_seed_the_bus_carries_is_reduced_mod_2_63():
    logits = torch.randn(1, V).expand(32, V)
    pos = torch.arange(32).unsqueeze(1)

    def draws(seed: int) -> torch.Tensor:
        return sample(logits, SamplingInfo.build([SamplingParams(sampling_seed=seed)] * 32, V, "cpu"), pos)

    assert torch.equal(draws(1 << 63), draws(0))  # "Overflow when unpacking long long" before
    assert torch.equal(draws((1 << 64) - 1), draws((1 << 63) - 1))
    assert torch.equal(draws(-1), draws((1 << 63) - 1))
    assert not torch.equal(draws(1), draws(0))


def test_rows_without_finite_logits_get_minus_one_and_leave_their_neighbours_alone():
    torch.manual_seed(2)
    good = torch.randn(V)
    inf_row = torch.zeros(V)
    inf_row[3] = float("inf")  # an overflowing bias: that token, not a crash
    huge = torch.zeros(V)
    huge[4] = 1e35  # finite, but inf once divided by a small temperature
    some_nan = torch.randn(V)
    some_nan[::2] = float("nan")  # those tokens are out
    rows = [good, inf_row, huge, some_nan, torch.full((V,), float("nan")), torch.full((V,), float("-inf"))]
    seeded = SamplingParams(temperature=1.0, sampling_seed=5)
    params = [seeded, SamplingParams(), SamplingParams(temperature=1e-5), SamplingParams(),
              SamplingParams(), SamplingParams(temperature=0)]  # fmt: skip
    pos = torch.zeros(len(rows), 1, dtype=torch.int64)
    for _ in range(20):
        out = sample(torch.stack(rows), SamplingInfo.build(params, V, "cpu"), pos).tolist()
        assert out[1:3] == [3, 4] and out[3] % 2 == 1 and out[4:] == [-1, -1]
        alone = sample(good.unsqueeze(0), SamplingInfo.build([seeded], V, "cpu"), pos[:1])
        assert out[0] == alone.item()


def test_the_overlap_path_repairs_in_place_as_the_checked_path_does():
    """check=False (overlap scheduling) repairs without looking first; same ids as check=True."""
    torch.manual_seed(3)
    rows = torch.randn(6, V)
    rows[1, 3] = float("inf")
    rows[2, 4] = 1e35
    rows[3, ::2] = float("nan")
    rows[4] = float("nan")
    rows[5] = float("-inf")
    rows[0, 6] = -1e35  # finite, past the cap: allowed (as -cap), not banned
    greedy = SamplingInfo.build([SamplingParams(temperature=0)] * 6, V, "cpu")
    pos = torch.zeros(6, 1, dtype=torch.int64)
    checked = sample(rows.clone(), greedy, pos)
    scratch = rows.clone()
    assert torch.equal(sample(scratch, greedy, pos, check=False), checked)
    assert checked.tolist()[1:] == [3, 4, rows[3].nan_to_num(float("-inf")).argmax().item(), -1, -1]
    assert not scratch.isnan().any() and scratch.max() <= 1e30 and (scratch[4:] == 0).all()
    low = torch.full((1, V), float("-inf"))
    low[0, 5] = -1e35
    assert sample(low, greedy, pos[:1], check=False).item() == 5


@pytest.mark.parametrize("check", [True, False])
def test_a_draw_in_slices_of_rows_gives_the_draw_in_one_go(monkeypatch, check):
    """Past DRAW_SLICE_LOGITS a sampled batch is drawn a slice of rows at a time (bounded memory):
    seeded and greedy rows (the deterministic ones) come out as in one go, dead rows still -1."""
    import services.scheduler.sampling.sampler as sampler_module

    torch.manual_seed(4)
    rows = torch.randn(11, V) * 3
    rows[7] = float("nan")
    seeded = [SamplingParams(temperature=0.7, top_p=0.9, sampling_seed=i) for i in range(11)]
    params = [p if i % 3 else SamplingParams(temperature=0) for i, p in enumerate(seeded)]
    info = SamplingInfo.build(params, V, "cpu")
    pos = torch.arange(11).unsqueeze(1)
    whole = sample(rows.clone(), info, pos, check=check)
    monkeypatch.setattr(sampler_module, "DRAW_SLICE_LOGITS", 3 * V)  # slices of 3 rows
    sliced = sample(rows.clone(), info, pos, check=check)
    assert torch.equal(sliced, whole) and whole[7].item() == -1


def test_an_all_greedy_batch_builds_no_columns(monkeypatch):
    """The throughput case: no per-row tensors, no host copies; the draw is the argmax (repaired)."""
    import services.scheduler.sampling.sampler as sampler_module

    copies: list[int] = []
    monkeypatch.setattr(sampler_module, "to_device", lambda *a: copies.append(1))
    info = SamplingInfo.build([SamplingParams(temperature=0)] * 3, V, "cpu")
    assert copies == [] and info.all_greedy and info.temperatures is None and info.rows(0, 2) is info
    logits = torch.randn(3, V)
    logits[1] = float("nan")
    pos = torch.zeros(3, 1, dtype=torch.int64)
    for check in (True, False):
        got = sample(logits.clone(), info, pos, check=check).tolist()
        assert got == [logits[0].argmax().item(), -1, logits[2].argmax().item()]


@pytest.mark.parametrize("check", [True, False])
def test_bf16_logits_draw_as_their_float32_copy(check):
    """A GPU model hands over its logits in bf16 (no float32 copy for a plain greedy batch): every kind
    of row draws from them what it draws from their float32 copy, repairs and dead rows included."""
    torch.manual_seed(5)
    rows = (torch.randn(9, V) * 4).to(torch.bfloat16)
    rows[1, 2] = float("inf")
    rows[4] = float("nan")
    rows[5, ::2] = float("-inf")
    rows[6, :4] = rows[6].max()  # a tie: the first index, as torch.argmax
    pos = torch.arange(9).unsqueeze(1)
    greedy = [SamplingParams(temperature=0)] * 9
    seeded = [
        SamplingParams(temperature=0.8, top_k=5, sampling_seed=i) if i % 2 else g
        for i, g in enumerate(greedy)
    ]
    for params in (greedy, seeded):
        info = SamplingInfo.build(params, V, "cpu")
        want = sample(rows.float(), info, pos, check=check)
        assert torch.equal(sample(rows.clone(), info, pos, check=check), want)
        assert want[4].item() == -1 and want[1].item() == 2
