"""Every model family against HF transformers on the same weights (fp32, CPU): a tiny model with random
weights is built from a transformers config (`from_config`, `save_pretrained`: no download), and
sglbus's greedy output must equal transformers' token for token — one prompt at a time, as one batch,
with prefill in chunks smaller than the prompts, and again when the radix cache holds the prefixes.
Sliding windows are shorter than the prompts (and the test checks that the window changes
transformers' own output there, so a backend ignoring it fails). Logprobs, constrained decoding and
n > 1 run on every family too."""

from __future__ import annotations

import os
import re

import pytest
import torch
from tiny_families import FAMILIES, NEW, build_hf, hf_greedy, save_folder

PROMPT_LENS = (5, 17, 31)
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, model_folder):
    """(name, HF model, its folder with the default tokenizer, prompts, HF's greedy outputs)."""
    model_type, overrides = FAMILIES[request.param]
    hf = build_hf(model_type, overrides)
    folder = save_folder(hf, str(tmp_path_factory.mktemp(request.param)), model_folder)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return request.param, hf, folder, prompts, [hf_greedy(hf, p) for p in prompts]


@pytest.fixture(scope="module")
def engine(family):
    from sglbus import Engine

    e = Engine(model_path=family[2], dtype="float32", chunked_prefill_size=16)
    yield e
    e.check_integrity()
    e.shutdown()


def test_greedy_output_equals_transformers(family, engine):
    name, hf, folder, prompts, refs = family
    one = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert one == refs
    batch = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == refs
    # the prompts are cached now: a request that extends one starts from the radix cache
    longer = prompts[2] + refs[2][:4]
    out = engine.generate(input_ids=longer, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] >= len(prompts[2]) - 16
    assert out["output_ids"] == hf_greedy(hf, longer)


def test_the_window_matters_here(family):
    """A window shorter than the prompts changes transformers' output, so the parity above covers it."""
    name, hf, folder, prompts, refs = family
    if getattr(hf.config, "sliding_window", None) is None:
        pytest.skip(f"{name} has no sliding window in this test")
    model_type, overrides = FAMILIES[name]
    full = build_hf(model_type, {**overrides, "sliding_window": 4096})
    full.load_state_dict(hf.state_dict())
    assert hf_greedy(full, prompts[2]) != refs[2]


def test_logprobs_equal_transformers(family, engine):
    name, hf, folder, prompts, refs = family
    prompt = prompts[1]
    out = engine.generate(
        input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=3
    )
    x = torch.tensor([prompt + out["output_ids"]])
    with torch.inference_mode():
        ref = torch.log_softmax(hf(x).logits[0].float(), dim=-1)
    meta = out["meta_info"]
    for i, (lp, tok, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert tok == prompt[i] and abs(lp - ref[i - 1, tok].item()) < 1e-4
    for j, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(lp - ref[len(prompt) - 1 + j, tok].item()) < 1e-4
        assert meta["output_top_logprobs"][j][0][1] == tok  # greedy: the top token is the one drawn


def test_constrained_and_parallel_sampling(family, engine):
    name, hf, folder, prompts, refs = family
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    regex = {"temperature": 0, "max_new_tokens": 24, "regex": phone}
    out = engine.generate(input_ids=prompts[0], sampling_params=regex)
    assert re.fullmatch(phone, out["text"]), out["text"]
    sampled = {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "sampling_seed": 7}
    many = engine.generate(input_ids=prompts[1], sampling_params=sampled)
    assert len(many) == 3 and all(len(o["output_ids"]) == 6 for o in many)
    assert len({tuple(o["output_ids"]) for o in many}) > 1


def test_a_sharded_checkpoint_with_tied_embeddings(tmp_path, model_folder):
    """Shards listed by model.safetensors.index.json are read, and only they (a stray copy of the
    weights beside them, as Mistral's repos ship, is not); a tied LM head comes from the embeddings."""
    from safetensors.torch import save_file

    from sglbus import Engine

    hf = build_hf("qwen2", {"tie_word_embeddings": True}, seed=3)
    folder = save_folder(hf, str(tmp_path / "sharded"), model_folder, max_shard_size="1MB")
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in os.listdir(folder)
    save_file({"output.weight": torch.zeros(2, 2)}, os.path.join(folder, "consolidated.safetensors"))
    prompt = list(range(100, 120))
    e = Engine(model_path=folder, dtype="float32")
    try:
        assert e.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == hf_greedy(hf, prompt)
    finally:
        e.shutdown()
