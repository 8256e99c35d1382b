"""Logprobs against HF transformers' log_softmax at the same positions (fp32, |diff| < 1e-4), the same
with and without a prefix-cache hit and with chunked prefill, cumulative in streams; flat and base64
prompt arrays; n > 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglbus.logprobs import decode_flat, decode_flat_b64

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far away, there lived a dragon who",
]
NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
TOP = 3
IDS = [0, 7, 198, 4649]
TOL = 1e-4


@pytest.fixture(scope="module")
def prompt_ids(model_folder):
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(model_folder)
    return [tok.encode(p) for p in PROMPTS]


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's fp32 logits at every position of `ids`: row p is the distribution of ids[p+1]."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def ask(**extra):
    return {"return_logprob": True, "top_logprobs_num": TOP, "token_ids_logprob": IDS, **extra}


def check_against(meta: dict, ref: torch.Tensor, prompt: list[int], output: list[int], start: int) -> None:
    full = prompt + output
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt[start:]
    for i, entry in enumerate(inp):
        pos = start + i
        if pos == 0:
            assert entry[0] is None and meta["input_top_logprobs"][0] is None
            continue
        assert abs(entry[0] - ref[pos - 1, prompt[pos]].item()) < TOL
        check_top(meta["input_top_logprobs"][i], ref[pos - 1])
        check_ids(meta["input_token_ids_logprobs"][i], ref[pos - 1])
    out = meta["output_token_logprobs"]
    assert [e[1] for e in out] == output
    for j, entry in enumerate(out):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry[0] - row[full[len(prompt) + j]].item()) < TOL
        check_top(meta["output_top_logprobs"][j], row)
        check_ids(meta["output_token_ids_logprobs"][j], row)


def check_top(top: list, row: torch.Tensor) -> None:
    vals = [e[0] for e in top]
    assert vals == sorted(vals, reverse=True) and len(top) == TOP
    ref_vals, ref_ids = row.topk(TOP)
    assert np.allclose(vals, ref_vals.tolist(), atol=TOL)
    for (v, t, _), rv in zip(top, ref_vals.tolist(), strict=True):
        assert abs(row[t].item() - v) < TOL  # the id carries its own logprob
        assert abs(v - rv) < TOL


def check_ids(entries: list, row: torch.Tensor) -> None:
    assert [e[1] for e in entries] == IDS
    for v, t, _ in entries:
        assert abs(v - row[t].item()) < TOL


def test_matches_hf_log_softmax(engine, hf_model, prompt_ids):
    outs = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY, **ask(logprob_start_len=0))
    for out, ids in zip(outs, prompt_ids, strict=True):
        ref = hf_logprobs(hf_model, ids + out["output_ids"])
        check_against(out["meta_info"], ref, ids, out["output_ids"], 0)
        # greedy: each output token is the top-1 of its distribution
        assert [t[0][1] for t in out["meta_info"]["output_top_logprobs"]] == out["output_ids"]


def test_start_len_and_output_only(engine, hf_model, prompt_ids):
    ids = prompt_ids[2]
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, **ask(logprob_start_len=5))
    check_against(out["meta_info"], hf_logprobs(hf_model, ids + out["output_ids"]), ids, out["output_ids"], 5)
    only = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)["meta_info"]
    assert only["input_token_logprobs"] == [] and len(only["output_token_logprobs"]) == NEW
    assert "output_top_logprobs" not in only and "output_token_ids_logprobs" not in only
    past = engine.generate(input_ids=ids, sampling_params=GREEDY, **ask(logprob_start_len=len(ids)))
    assert past["meta_info"]["input_token_logprobs"] == []


def test_same_with_cache_hit_and_chunked_prefill(make_engine, prompt_ids):
    ids = prompt_ids[2]
    params = {**GREEDY, "max_new_tokens": 2}
    one_shot = make_engine()
    cold = one_shot.generate(input_ids=ids, sampling_params=params, **ask(logprob_start_len=3))
    assert cold["meta_info"]["cached_tokens"] == 0
    # the whole prompt is cached now; prompt logprobs from position 3 need positions 2.. recomputed
    warm = one_shot.generate(input_ids=ids, sampling_params=params, **ask(logprob_start_len=3))
    assert warm["meta_info"]["cached_tokens"] == 2
    plain = one_shot.generate(input_ids=ids, sampling_params=params)
    assert plain["meta_info"]["cached_tokens"] == len(ids) - 1
    chunked = make_engine(chunked_prefill_size=4).generate(
        input_ids=ids, sampling_params=params, **ask(logprob_start_len=3)
    )
    for other in (warm, chunked):
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
                    "output_token_logprobs"):  # fmt: skip
            assert _close(cold["meta_info"][key], other["meta_info"][key]), key


def _close(a, b) -> bool:
    """Nested [logprob, id, text] structures equal up to float noise between batch shapes."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < TOL
    return a == b


def test_zero_new_tokens_reads_the_next_token_logprobs(engine, hf_model, prompt_ids):
    """max_new_tokens=0 with top / listed logprobs (SGLang's frontend reads the likely next tokens as
    `output_top_logprobs[0]`): no output, finish length 0, one top and one ids row for the position
    after the prompt, as HF computes it, beside a request in the same batch that draws (as SGLang,
    `output_token_logprobs` stays empty: there is no token). No KV is left behind (the fixture's
    integrity check)."""
    params = [{"max_new_tokens": 0}, GREEDY, {"max_new_tokens": 0}]
    outs = engine.generate(
        input_ids=prompt_ids, sampling_params=params, return_text_in_logprobs=True, **ask()
    )
    for i in (0, 2):
        out, ids = outs[i], prompt_ids[i]
        meta = out["meta_info"]
        assert out["output_ids"] == [] and out["text"] == "" and meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["output_token_logprobs"] == [] and len(meta["output_top_logprobs"]) == 1
        row = hf_logprobs(hf_model, ids)[-1]
        check_top(meta["output_top_logprobs"][0], row)
        check_ids(meta["output_token_ids_logprobs"][0], row)
        assert all(isinstance(e[2], str) for e in meta["output_top_logprobs"][0])
    ref = hf_logprobs(hf_model, prompt_ids[1] + outs[1]["output_ids"])
    check_against(outs[1]["meta_info"], ref, prompt_ids[1], outs[1]["output_ids"], len(prompt_ids[1]))
    # the same row the first output token of a one-token request gets; streamed alike
    opts = ask(return_text_in_logprobs=True)
    one = engine.generate(input_ids=prompt_ids[0], sampling_params={**GREEDY, "max_new_tokens": 1}, **opts)
    top = one["meta_info"]["output_top_logprobs"]
    assert _close(outs[0]["meta_info"]["output_top_logprobs"], top)
    chunks = list(engine.generate(input_ids=prompt_ids[0], sampling_params=params[0], stream=True, **opts))
    assert _close(chunks[-1]["meta_info"]["output_top_logprobs"], top)
    plain = engine.generate(input_ids=prompt_ids[0], sampling_params=params[0], return_logprob=True)
    assert plain["meta_info"]["output_token_logprobs"] == []
    assert "output_top_logprobs" not in plain["meta_info"]


def test_streaming_logprobs_are_cumulative(engine, prompt_ids):
    chunks = list(
        engine.generate(
            input_ids=prompt_ids[0], sampling_params=GREEDY, stream=True, **ask(logprob_start_len=0)
        )
    )
    assert len(chunks) >= 2
    for c in chunks:
        meta = c["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(c["output_ids"])
        assert len(meta["output_top_logprobs"]) == len(c["output_ids"])
        assert len(meta["input_token_logprobs"]) == len(prompt_ids[0])
    final = chunks[-1]["meta_info"]["output_token_logprobs"]
    assert chunks[1]["meta_info"]["output_token_logprobs"] == final[: len(chunks[1]["output_ids"])]


def test_text_in_logprobs(engine, model_folder, prompt_ids):
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(model_folder)
    meta = engine.generate(
        input_ids=prompt_ids[0],
        sampling_params=GREEDY,
        return_text_in_logprobs=True,
        **ask(logprob_start_len=0),
    )["meta_info"]
    for _v, t, text in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert text == tok.decode([t])
    plain = engine.generate(input_ids=prompt_ids[0], sampling_params=GREEDY, **ask(logprob_start_len=0))
    assert all(e[2] is None for e in plain["meta_info"]["output_token_logprobs"])


def test_flat_and_b64_prompt_arrays(engine, prompt_ids):
    lists = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY, **ask(logprob_start_len=0))
    flat = engine.generate(
        input_ids=prompt_ids,
        sampling_params=GREEDY,
        return_flat_raw_top_logprobs=True,
        **ask(logprob_start_len=0),
    )
    b64 = engine.generate(
        input_ids=prompt_ids, sampling_params=GREEDY, return_flat_raw_top_logprobs=True,
        return_flat_raw_top_logprobs_b64=True, **ask(logprob_start_len=0),
    )  # fmt: skip
    for ref, f, b, ids in zip(lists, flat, b64, prompt_ids, strict=True):  # every batch item has them
        fm, bm = f["meta_info"], b["meta_info"]
        assert "input_top_logprobs" not in fm and "input_top_logprobs" not in bm
        assert "input_top_logprobs_val_flat" not in bm and "input_top_logprobs_val_flat_b64" not in fm
        assert fm["input_top_logprobs_shape"] == bm["input_top_logprobs_shape"] == [len(ids) - 1, TOP]
        assert fm["input_top_logprobs_null_prefix"] == bm["input_top_logprobs_null_prefix"] == 1
        fv, fi = decode_flat(fm, "input_top_logprobs")
        bv, bi = decode_flat_b64(bm, "input_top_logprobs")
        assert np.array_equal(fv, bv) and np.array_equal(fi, bi)
        top = ref["meta_info"]["input_top_logprobs"]
        assert np.allclose(fv, [[e[0] for e in row] for row in top[1:]])
        assert fi.tolist() == [[e[1] for e in row] for row in top[1:]]
        # the output side keeps SGLang's lists
        assert len(fm["output_top_logprobs"]) == NEW


def test_b64_output_top_logprobs(engine, prompt_ids):
    ref = engine.generate(input_ids=prompt_ids[0], sampling_params=GREEDY, **ask())["meta_info"]
    meta = engine.generate(
        input_ids=prompt_ids[0], sampling_params=GREEDY, return_output_top_logprobs_b64=True, **ask()
    )["meta_info"]
    assert "output_top_logprobs" not in meta and meta["output_top_logprobs_shape"] == [NEW, TOP]
    vals, idx = decode_flat_b64(meta, "output_top_logprobs")
    assert np.allclose(vals, [[e[0] for e in row] for row in ref["output_top_logprobs"]])
    assert idx.tolist() == [[e[1] for e in row] for row in ref["output_top_logprobs"]]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"return_flat_raw_top_logprobs_b64": True, "return_logprob": True}, "return_flat_raw_top_logprobs"),
        ({"top_logprobs_num": 2}, "return_logprob"),
        ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"return_logprob": True, "token_ids_logprob": [10**9]}, "token_ids_logprob"),
        ({"return_logprob": "yes"}, "return_logprob"),
    ],
)
def test_bad_logprob_options(engine, extra, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(text="hi", sampling_params=GREEDY, **extra)


def test_n_samples_share_the_prompt_and_reproduce(engine, prompt_ids):
    ids = prompt_ids[2]
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "n": 3, "sampling_seed": 11}
    first = engine.generate(input_ids=ids, sampling_params=params)
    again = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(first, list) and len(first) == 3
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in first}) > 1  # the samples differ from each other
    for o in first:  # the prompt was prefilled once, then every sample found it in the cache
        assert o["meta_info"]["cached_tokens"] == len(ids) - 1
    # a batch with n: grouped prompt by prompt
    batch = engine.generate(input_ids=prompt_ids[:2], sampling_params={**params, "n": 2})
    assert len(batch) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [len(prompt_ids[0])] * 2 + [
        len(prompt_ids[1])
    ] * 2


def test_n_with_logprobs_and_stream(engine, prompt_ids):
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True, "n": 2}
    single = engine.generate(
        input_ids=prompt_ids[0], sampling_params={**params, "n": 1}, **ask(logprob_start_len=0)
    )
    outs = engine.generate(input_ids=prompt_ids[0], sampling_params=params, **ask(logprob_start_len=0))
    for o in outs:  # greedy samples agree; the prompt logprobs were computed once, by the prefill
        assert o["output_ids"] == single["output_ids"]
        assert o["meta_info"]["cached_tokens"] == len(prompt_ids[0]) - 1
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
                    "output_token_logprobs", "output_top_logprobs"):  # fmt: skip
            assert _close(o["meta_info"][key], single["meta_info"][key]), key
    chunks = list(engine.generate(input_ids=prompt_ids[0], sampling_params=params, stream=True))
    assert {c["index"] for c in chunks} == {0, 1}


def test_retraction_and_tiny_chunks_keep_logprobs(engine, make_engine, prompt_ids):
    """A pool so small that requests are retracted mid-run, and 5-token prefill chunks: every prompt and
    output position still gets exactly one logprob, equal to the roomy one-shot run's (the module
    engine's, whose cache holds the prompts: it recomputes them from position 1)."""
    params = {**GREEDY, "max_new_tokens": 16}
    opts = ask(logprob_start_len=1)
    roomy = engine.generate(input_ids=prompt_ids, sampling_params=params, **opts)
    tight = make_engine(max_total_tokens=60, new_token_ratio=0.0, chunked_prefill_size=5)
    outs = tight.generate(input_ids=prompt_ids, sampling_params=params, **opts)
    assert tight.get_stats()["retractions"] > 0
    for a, b in zip(roomy, outs, strict=True):
        assert a["output_ids"] == b["output_ids"]
        for key in (
            "input_token_logprobs",
            "input_top_logprobs",
            "output_token_logprobs",
            "output_top_logprobs",
        ):
            assert _close(a["meta_info"][key], b["meta_info"][key]), key


def test_scheduler_refuses_bad_logprob_requests_that_skip_the_gateway(engine):
    """A GenerateReq straight off the bus with an out-of-vocabulary id ends alone with a 400 abort; the
    step of the other requests is untouched."""
    from shared.messages import GenerateReq, LogprobReq
    from shared.sampling_params import SamplingParams

    def add_and_take(s):
        bad = LogprobReq(start_len=0, top_k=1, token_ids=[10**9])
        msg = GenerateReq(rid="raw-bad", input_ids=[1, 2, 3], sampling=SamplingParams(), out_subject="x")
        msg.logprob = bad
        s.add_request(msg)
        return s.take_output()

    out = engine._on_scheduler(add_and_take)
    assert out.rids == ["raw-bad"] and out.finish_reasons[0].status_code == 400
    assert "token_ids" in out.finish_reasons[0].message
    good = engine.generate(text="still fine", sampling_params=GREEDY, **ask())
    assert len(good["meta_info"]["output_token_logprobs"]) == NEW


def test_a_bf16_model_draws_alike_with_and_without_a_float32_processor(make_engine, prompt_ids, hf_model):
    """A bf16 model's logits stay bf16 for a plain greedy batch and get a float32 copy when a logits
    processor runs (here the output-logprob capture): the same tokens either way, and the logprobs
    (prompt and output) are those of float32 log_softmax over the bf16 logits, near HF's fp32 ones."""
    e = make_engine(dtype="bfloat16")
    plain = e.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    scored = e.generate(input_ids=prompt_ids, sampling_params=GREEDY, **ask(logprob_start_len=0))
    for ids, a, b in zip(prompt_ids, plain, scored, strict=True):
        assert a["output_ids"] == b["output_ids"]
        ref = hf_logprobs(hf_model, ids + b["output_ids"])
        got = [entry[0] for entry in b["meta_info"]["input_token_logprobs"][1:]]
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert max(abs(g - w) for g, w in zip(got, want.tolist(), strict=True)) < 0.5  # bf16 weights
        assert [t[0][1] for t in b["meta_info"]["output_top_logprobs"]] == b["output_ids"]
