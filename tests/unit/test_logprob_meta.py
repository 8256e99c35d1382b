"""The gateway's LogprobAccumulator: raw arrays from the bus (several chunks) become SGLang's meta_info
keys with the right positions, null prefix, flat and base64 forms."""

from __future__ import annotations

import numpy as np

from services.gateway.logprob_fields import decode_flat, decode_flat_b64
from services.gateway.logprob_meta import LogprobAccumulator
from services.gateway.logprob_options import LogprobOptions
from services.scheduler.logprobs import Rows, pack

PROMPT = [10, 11, 12, 13, 14]


def rows(m: int, k: int, n_ids: int, base: float) -> Rows:
    token = -np.arange(1, m + 1, dtype=np.float32) * base
    top_val = -np.tile(np.arange(k, dtype=np.float32), (m, 1)) - base
    top_idx = np.arange(m * k, dtype=np.int32).reshape(m, k)
    ids_val = np.full((m, n_ids), -base * 2, np.float32)
    return Rows(token, top_val, top_idx, ids_val)


def opts(**kw) -> LogprobOptions:
    base = dict(start_len=0, top_k=2, token_ids=[3], text=False, flat=False, flat_b64=False, output_b64=False)
    return LogprobOptions(**{**base, **kw})


def texts(ids: list[int]) -> list[str]:
    return [f"t{i}" for i in ids]


def test_positions_null_first_and_chunks_concatenate():
    acc = LogprobAccumulator(opts(text=True), PROMPT, texts)
    acc.add(pack([rows(2, 2, 1, 1.0)], []))  # prompt positions 1, 2 (a prefill chunk)
    acc.add(pack([rows(2, 2, 1, 2.0)], [rows(1, 2, 1, 3.0)]))  # positions 3, 4 and the first output
    meta = acc.meta([99])
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == PROMPT and inp[0][0] is None
    assert [e[0] for e in inp[1:]] == [-1.0, -2.0, -2.0, -4.0]
    assert inp[2][2] == "t12"
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 5
    assert meta["input_top_logprobs"][1] == [[-1.0, 0, "t0"], [-2.0, 1, "t1"]]
    assert meta["input_token_ids_logprobs"][1] == [[-2.0, 3, "t3"]]
    assert meta["output_token_logprobs"] == [[-3.0, 99, "t99"]]


def test_start_len_past_zero_has_no_null_and_past_the_prompt_is_empty():
    acc = LogprobAccumulator(opts(start_len=3), PROMPT, texts)
    acc.add(pack([rows(2, 2, 1, 1.0)], []))
    meta = acc.meta([])
    assert [e[1] for e in meta["input_token_logprobs"]] == [13, 14]
    assert meta["input_token_logprobs"][0][0] == -1.0
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    late = LogprobAccumulator(opts(start_len=9), PROMPT, texts).meta([])
    assert late["input_token_logprobs"] == [] and late["input_top_logprobs"] == []


def test_flat_b64_and_output_b64():
    acc = LogprobAccumulator(opts(flat=True, flat_b64=True, output_b64=True), PROMPT, texts)
    acc.add(pack([rows(4, 2, 1, 1.0)], [rows(3, 2, 1, 1.0)]))
    meta = acc.meta([7, 8, 9])
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    assert meta["input_top_logprobs_shape"] == [4, 2] and meta["input_top_logprobs_null_prefix"] == 1
    vals, idx = decode_flat_b64(meta, "input_top_logprobs")
    assert np.array_equal(vals, rows(4, 2, 1, 1.0).top_val) and np.array_equal(
        idx, np.arange(8).reshape(4, 2)
    )
    assert meta["output_top_logprobs_shape"] == [3, 2] and meta["output_top_logprobs_null_prefix"] == 0
    assert [e[1] for e in meta["output_token_logprobs"]] == [7, 8, 9]


def test_flat_output_top_logprobs_as_lists():
    acc = LogprobAccumulator(opts(output_flat=True), PROMPT, texts)
    acc.add(pack([rows(4, 2, 1, 1.0)], [rows(3, 2, 1, 1.0)]))
    meta = acc.meta([7, 8, 9])
    assert "output_top_logprobs" not in meta and "output_top_logprobs_val_flat_b64" not in meta
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 5  # input: nested
    vals, idx = decode_flat(meta, "output_top_logprobs")
    assert np.array_equal(vals, rows(3, 2, 1, 1.0).top_val) and np.array_equal(
        idx, np.arange(6).reshape(3, 2)
    )
    assert meta["output_top_logprobs_shape"] == [3, 2] and meta["output_top_logprobs_null_prefix"] == 0
