"""`POST /generate` as JSON against the served system: shapes, batches, request ids, the prefix cache
and stop conditions, as an SGLang client sees them."""

from __future__ import annotations

import uuid

from it_helpers import META_KEYS, PROMPT, generate, greedy, same_output


def test_single_text_response_shape(client, tokenizer):
    out = generate(client, {"text": PROMPT, "sampling_params": greedy(8, ignore_eos=True)})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert 0 < meta["e2e_latency"] < 60
    assert all(isinstance(t, int) and 0 <= t < 49152 for t in out["output_ids"])
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"].strip()


def test_input_ids_give_the_same_output_as_text(client, tokenizer):
    sp = greedy(6, ignore_eos=True)
    by_text = generate(client, {"text": PROMPT, "sampling_params": sp})
    ids = tokenizer.encode(PROMPT)
    by_ids = generate(client, {"input_ids": ids, "sampling_params": sp})
    assert same_output(by_ids, by_text)
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)


def test_batch_of_texts_with_per_prompt_sampling_params(client):
    texts = ["The capital of France is", "Once upon a time"]
    params = [greedy(3, ignore_eos=True), greedy(5, ignore_eos=True)]
    out = generate(client, {"text": texts, "sampling_params": params})
    assert isinstance(out, list) and len(out) == 2
    for res, text, sp in zip(out, texts, params, strict=True):
        assert set(res) == {"text", "output_ids", "meta_info"} and set(res["meta_info"]) == META_KEYS
        assert res["meta_info"]["completion_tokens"] == sp["max_new_tokens"]
        assert res["meta_info"]["finish_reason"] == {"type": "length", "length": sp["max_new_tokens"]}
        alone = generate(client, {"text": text, "sampling_params": sp})
        assert same_output(res, alone), "a batch entry must equal the prompt sent alone, in order"
    assert len({r["meta_info"]["id"] for r in out}) == 2


def test_batch_of_input_ids(client, tokenizer):
    rows = [tokenizer.encode("Hello, my name is"), tokenizer.encode("The sky is")]
    out = generate(client, {"input_ids": rows, "sampling_params": greedy(3, ignore_eos=True)})
    assert [r["meta_info"]["prompt_tokens"] for r in out] == [len(r) for r in rows]
    assert all(len(r["output_ids"]) == 3 for r in out)


def test_rid_string_and_list(client):
    base = f"rid-{uuid.uuid4().hex[:8]}"
    one = generate(client, {"text": PROMPT, "rid": base, "sampling_params": greedy(1)})
    assert one["meta_info"]["id"] == base
    batch = generate(client, {"text": [PROMPT, "Hi"], "rid": base, "sampling_params": greedy(1)})
    assert [r["meta_info"]["id"] for r in batch] == [f"{base}_0", f"{base}_1"]
    rids = [f"{base}-a", f"{base}-b"]
    listed = generate(client, {"text": [PROMPT, "Hi"], "rid": rids, "sampling_params": greedy(1)})
    assert [r["meta_info"]["id"] for r in listed] == rids


def test_greedy_is_reproducible_and_the_repeat_hits_the_prefix_cache(client):
    prompt = f"Reproducibility check {uuid.uuid4().int % 10_000_000}: a short note"
    body = {"text": prompt, "sampling_params": greedy(8)}
    first = generate(client, body)
    second = generate(client, body)
    assert same_output(first, second)
    n = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    # the last prompt token is always computed (it yields the first logits)
    assert second["meta_info"]["cached_tokens"] == n - 1 > 0


def test_max_new_tokens_zero_is_prefill_only(client):
    out = generate(client, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_stop_strings_are_trimmed(client):
    sp = greedy(16, ignore_eos=True)
    ref = generate(client, {"text": PROMPT, "sampling_params": sp})
    text = ref["text"]
    stop = text[8:11]
    cut = text.index(stop)
    out = generate(client, {"text": PROMPT, "sampling_params": {**sp, "stop": stop}})
    assert out["text"] == text[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta_info"]["completion_tokens"] < 16
    assert out["output_ids"] == ref["output_ids"][: len(out["output_ids"])]
    kept = generate(
        client, {"text": PROMPT, "sampling_params": {**sp, "stop": ["zzzz", stop], "no_stop_trim": True}}
    )
    assert kept["text"] == text[: cut + len(stop)]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_token_ids(client):
    sp = greedy(12, ignore_eos=True)
    ref = generate(client, {"text": PROMPT, "sampling_params": sp})
    stop_at = ref["output_ids"][4]
    first = ref["output_ids"].index(stop_at)
    out = generate(client, {"text": PROMPT, "sampling_params": {**sp, "stop_token_ids": [stop_at]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert out["output_ids"] == ref["output_ids"][: first + 1]
    assert out["meta_info"]["completion_tokens"] == first + 1


def test_stop_token_text_is_trimmed_like_sglang(client):
    """SGLang's detokenizer drops a matched stop token from the text (`trim_matched_stop`), unless
    no_stop_trim; output_ids keep it."""
    sp = greedy(12, ignore_eos=True)
    ref = generate(client, {"text": PROMPT, "sampling_params": sp})
    stop_at = ref["output_ids"][4]
    first = ref["output_ids"].index(stop_at)
    before = generate(client, {"text": PROMPT, "sampling_params": greedy(first, ignore_eos=True)})
    out = generate(client, {"text": PROMPT, "sampling_params": {**sp, "stop_token_ids": [stop_at]}})
    assert out["text"] == before["text"]
    kept = generate(
        client, {"text": PROMPT, "sampling_params": {**sp, "stop_token_ids": [stop_at], "no_stop_trim": True}}
    )
    upto = generate(client, {"text": PROMPT, "sampling_params": greedy(first + 1, ignore_eos=True)})
    assert kept["text"] == upto["text"]


def test_eos_finishes_with_stop_and_is_not_in_the_text(client):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    out = generate(client, {"text": chat, "sampling_params": greedy(64)})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert out["output_ids"][-1] == 2 and "<|im_end|>" not in out["text"]
