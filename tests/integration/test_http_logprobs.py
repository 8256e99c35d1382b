"""Logprobs, flat/base64 prompt arrays and n > 1 through the served system: the arrays cross NATS as raw
bytes (scheduler -> detokenizer -> gateway) and come out as SGLang's meta_info keys."""

from __future__ import annotations

import numpy as np
from it_helpers import PROMPT, generate, greedy, stream

from sglbus.logprobs import decode_flat, decode_flat_b64

ASK = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}


def test_logprobs_and_flat_b64_over_http(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"text": [PROMPT, PROMPT + " Indeed"], "sampling_params": greedy(4, ignore_eos=True), **ASK}
    lists = generate(client, body)
    flat = generate(client, {**body, "return_flat_raw_top_logprobs": True})
    b64 = generate(
        client, {**body, "return_flat_raw_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True}
    )
    for ref, f, b in zip(lists, flat, b64, strict=True):
        meta = ref["meta_info"]
        assert len(meta["output_token_logprobs"]) == 4
        assert [e[1] for e in meta["output_token_logprobs"]] == ref["output_ids"]
        assert meta["input_token_logprobs"][0][0] is None
        fv, fi = decode_flat(f["meta_info"], "input_top_logprobs")
        bv, bi = decode_flat_b64(b["meta_info"], "input_top_logprobs")
        # two requests: the same ids, and values equal up to float noise (a prompt's rows may be
        # computed in a differently shaped batch, whose matmuls round differently)
        assert np.array_equal(fi, bi) and np.allclose(fv, bv, rtol=0, atol=1e-4)
        assert fi.tolist() == [[e[1] for e in row] for row in meta["input_top_logprobs"][1:]]
    assert [e[1] for e in lists[0]["meta_info"]["input_token_logprobs"]] == ids


def test_streamed_logprobs_are_cumulative(client):
    body = {"text": PROMPT, "sampling_params": greedy(5, ignore_eos=True), **ASK, "stream": True}
    chunks = stream(client, body)
    for c in chunks:
        assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"])
    final = generate(client, {**body, "stream": False})
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == final["meta_info"]["output_token_logprobs"]


def test_n_samples_over_http(client):
    sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "n": 2, "sampling_seed": 3}
    first = generate(client, {"text": PROMPT, "sampling_params": sp})
    again = generate(client, {"text": PROMPT, "sampling_params": sp})
    assert len(first) == 2 and [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in first)


def test_bulk_prompt_logprobs_cross_the_bus(client):
    """1.2 MB of prompt top-logprob arrays in one scheduler output: over NATS' 1 MB default, within the
    64 MB our NATS is configured for; the arrays arrive whole."""
    ids = [(i * 7919) % 40000 + 100 for i in range(1500)]
    body = {"input_ids": ids, "sampling_params": greedy(1), "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 100, "return_flat_raw_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": True}  # fmt: skip
    meta = generate(client, body)["meta_info"]
    vals, idx = decode_flat_b64(meta, "input_top_logprobs")
    assert vals.shape == idx.shape == (1499, 100)
    assert np.all(np.diff(vals, axis=1) <= 0)  # best first
    assert [e[1] for e in meta["input_token_logprobs"]] == ids


def test_prompt_logprobs_larger_than_the_bus_are_refused(client):
    body = {"input_ids": [100 + i % 1000 for i in range(8000)], "sampling_params": greedy(1),
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1024,
            "token_ids_logprob": list(range(1024))}  # fmt: skip
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "prompt logprobs for 7999 positions" in message and "logprob_start_len" in message


def test_zero_new_tokens_reads_the_next_token_top_logprobs(client):
    """SGLang's zero-token gen (its frontend's cot_decoding): no output, finish length 0, and the top-k
    next tokens as `output_top_logprobs[0]`, the same the first token of a one-token request gets;
    `output_token_logprobs` stays empty (there is no token). The `srv` fixture checks no KV is left."""
    ask = {"return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    zero = generate(client, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, **ask})
    one = generate(client, {"text": PROMPT, "sampling_params": greedy(1), **ask})
    meta = zero["meta_info"]
    assert zero["text"] == "" and zero["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == [] and len(meta["output_top_logprobs"]) == 1
    (top,) = meta["output_top_logprobs"]
    (ref,) = one["meta_info"]["output_top_logprobs"]
    assert [e[1:] for e in top] == [e[1:] for e in ref] and top[0][1] == one["output_ids"][0]
    assert np.allclose([e[0] for e in top], [e[0] for e in ref], rtol=0, atol=1e-4)
    chunks = stream(client, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, **ask, "stream": True})
    assert [e[1] for e in chunks[-1]["meta_info"]["output_top_logprobs"][0]] == [e[1] for e in top]


def test_openai_max_tokens_zero_keeps_one_logprob_entry_per_token(client, tokenizer):
    """OpenAI's completions accept max_tokens=0 (echo + logprobs scores a prompt); the next position's
    row the scheduler sends stays out of OpenAI's per-token lists."""
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    n = len(tokenizer.encode(PROMPT))
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert r.json()["usage"]["completion_tokens"] == 0
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] == {"content": []}
