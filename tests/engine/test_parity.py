"""Greedy output must equal HF transformers token for token on the same weights (fp32), one prompt at a
time, as one mixed-length batch, with tiny prefill chunks, and again when the prefix cache hits."""

from __future__ import annotations

import pytest
import torch

NEW_TOKENS = 48
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
def prompt_ids(model_folder):
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(model_folder)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    """HF greedy continuations, one prompt at a time (no padding)."""
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = hf_model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            outs.append(y[0, len(ids) :].tolist())
    assert all(len(o) == NEW_TOKENS for o in outs)
    return outs


def test_one_at_a_time(make_engine, prompt_ids, reference):
    engine = make_engine()
    for ids, ref in zip(prompt_ids, reference, strict=True):
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert out["output_ids"] == ref
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}


def test_batch_and_cache_hit(make_engine, prompt_ids, reference):
    engine = make_engine()
    first = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in first] == reference
    assert [o["meta_info"]["prompt_tokens"] for o in first] == [len(p) for p in prompt_ids]
    # the same prompts again: their prefixes come from the radix cache, the output must not change
    second = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in second] == reference
    for o, ids in zip(second, prompt_ids, strict=True):
        assert o["meta_info"]["cached_tokens"] == len(ids) - 1


def test_tiny_chunked_prefill(make_engine, prompt_ids, reference):
    engine = make_engine(chunked_prefill_size=7)
    outs = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference


def test_text_matches_tokenizer_decode(make_engine, model_folder, prompt_ids, reference):
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(model_folder)
    engine = make_engine()
    outs = engine.generate(PROMPTS, GREEDY)
    for out, ref in zip(outs, reference, strict=True):
        assert out["output_ids"] == ref
        assert out["text"] == tok.decode(ref, skip_special_tokens=True)
