"""Tensor parallelism on CPU (gloo, one process per rank): `tp_size=2` gives the same greedy output as
one rank, token for token in fp32, on the default model (9 heads over 2 ranks: an uneven split, tied
embeddings) and on a tiny random model of every family (transformers' output is what one rank gives:
tests/engine/test_families.py), MoE included; with a batch, a cached prefix, prompt logprobs and
constrained decoding, under overlap scheduling; and with KV heads replicated when there are fewer
than ranks (tp_size=4)."""

from __future__ import annotations

import re

import psutil
import pytest
import torch
from tiny_families import FAMILIES, NEW, build_hf, hf_greedy, save_folder

GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}

pytestmark = pytest.mark.slow


def _followers() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children():
        try:
            if "services.scheduler.parallel.followers" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:  # gone, or a zombie (a grammar check's process)
            pass
    return out


def test_default_model_two_ranks_equal_one():
    from sglbus import Engine

    prompts = ["The capital of France is", "def fib(n):", "Once upon a time, in a land far away,"]
    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    out = {}
    for tp in (1, 2):
        # overlap scheduling (the GPU's default) and chunks so small that some steps sample nothing
        with Engine(dtype="float32", tp_size=tp, chunked_prefill_size=4, disable_overlap_schedule=False) as e:
            assert len(_followers()) == tp - 1
            greedy = [o["output_ids"] for o in e.generate(prompts, GREEDY)]
            again = e.generate(prompts[2] + " The", GREEDY)  # most of it from the radix cache
            assert again["meta_info"]["cached_tokens"] > 0
            logprobs = e.generate(prompts[0], GREEDY, **lp)["meta_info"]
            regex = e.generate(
                prompts[1], {"temperature": 0, "max_new_tokens": 16, "regex": r"[0-9]{3}-[a-z]+"}
            )
            assert re.fullmatch(r"[0-9]{3}-[a-z]+", regex["text"])
            e.check_integrity()
            out[tp] = greedy, again["output_ids"], logprobs, regex["text"]
        assert not _followers()  # shutdown stops the other ranks
    (g1, a1, lp1, r1), (g2, a2, lp2, r2) = out[1], out[2]
    assert (g2, a2, r2) == (g1, a1, r1)
    for key in ("input_token_logprobs", "output_token_logprobs"):
        for (x1, t1, _), (x2, t2, _) in zip(lp1[key][1:], lp2[key][1:], strict=True):
            assert t1 == t2 and abs(x1 - x2) < 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, model_folder):
    model_type, overrides = FAMILIES[request.param]
    hf = build_hf(model_type, overrides)
    folder = save_folder(hf, str(tmp_path_factory.mktemp(f"tp-{request.param}")), model_folder)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (7, 29)]
    return request.param, hf, folder, prompts


def test_every_family_two_ranks_equal_one(family):
    from sglbus import Engine

    name, hf, folder, prompts = family
    refs = [hf_greedy(hf, p) for p in prompts]
    with Engine(model_path=folder, dtype="float32", tp_size=2, chunked_prefill_size=16) as e:
        assert [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)] == refs
        longer = prompts[1] + refs[1][:3]  # extends a cached prompt
        out = e.generate(input_ids=longer, sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] >= 16
        assert out["output_ids"] == hf_greedy(hf, longer)
        e.check_integrity()


def test_kv_heads_replicated_over_more_ranks(tmp_path, model_folder):
    """4 ranks, 2 KV heads: each KV head is held by two ranks, each with one of its group's q heads."""
    from sglbus import Engine

    hf = build_hf("llama", {}, seed=5)
    folder = save_folder(hf, str(tmp_path / "llama"), model_folder)
    prompt = list(range(200, 223))
    with Engine(model_path=folder, dtype="float32", tp_size=4) as e:
        assert len(_followers()) == 3
        assert e.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == hf_greedy(hf, prompt)
