"""Greedy output must equal HF transformers token for token on the same weights (fp32), one prompt at a
time, as one mixed-length batch, with tiny prefill chunks, and again when the prefix cache hits."""

from __future__ import annotations

import pytest
import torch

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Translate to German: The weather is nice today and we are going for a walk in the park.",
    "1, 1, 2, 3, 5, 8, 13,",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. 日本語のテキストも少し。 Emojis: 🚀🌍",
    "<|im_start|>user\nWhat is the boiling point of water at sea level, in Celsius?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Once upon a time",
    "A long list of things to remember before travelling: passport, tickets, charger, adapter, "
    "toothbrush, medicine, a book for the flight, snacks, water bottle, headphones, a light jacket, "
    "insurance documents, the hotel address written down, and some local currency for the taxi.",
]
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(model_folder):
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(model_folder)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def cold_batch(engine):
    """The module engine's first run, so nothing is cached: every prompt as text, in one batch."""
    return engine.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids, cold_batch):
    """HF greedy continuations, one prompt at a time (no padding). Generating one costs NEW_TOKENS
    forward passes, checking one costs a single pass: `proposal` is HF's greedy output exactly when
    HF's argmax after prompt + proposal[:j] is proposal[j] for every j. The engine's cold batch is the
    proposal; where a prompt's is not HF's output, HF generates it (and the tests comparing fail)."""
    outs = []
    with torch.inference_mode():
        for ids, out in zip(prompt_ids, cold_batch, strict=True):
            proposal = out["output_ids"]
            x = torch.tensor([ids + proposal[:-1]])
            logits = hf_model(x, attention_mask=torch.ones_like(x)).logits[0, len(ids) - 1 :]
            if len(proposal) != NEW_TOKENS or logits.argmax(-1).tolist() != proposal:
                x = torch.tensor([ids])
                y = hf_model.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False
                )
                proposal = y[0, len(ids) :].tolist()
            outs.append(proposal)
    assert all(len(o) == NEW_TOKENS for o in outs)
    return outs


def test_one_at_a_time(make_engine, prompt_ids, reference):
    engine = make_engine()
    for ids, ref in zip(prompt_ids, reference, strict=True):
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert out["output_ids"] == ref
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}


def test_batch_text_and_cache_hit(engine, tokenizer, cold_batch, prompt_ids, reference):
    """The cold batch (text prompts, tokenized by the engine as by the tokenizer), then the same prompts
    again as ids: their prefixes come from the radix cache, and the output must not change."""
    assert [o["output_ids"] for o in cold_batch] == reference
    assert [o["meta_info"]["prompt_tokens"] for o in cold_batch] == [len(p) for p in prompt_ids]
    for out, ref in zip(cold_batch, reference, strict=True):
        assert out["text"] == tokenizer.decode(ref, skip_special_tokens=True)
    second = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in second] == reference
    for o, ids in zip(second, prompt_ids, strict=True):
        assert o["meta_info"]["cached_tokens"] == len(ids) - 1


def test_tiny_chunked_prefill(make_engine, prompt_ids, reference):
    engine = make_engine(chunked_prefill_size=7)
    outs = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
