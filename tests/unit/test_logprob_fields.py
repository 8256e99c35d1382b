"""services/gateway/logprob_fields.py: meta_info logprob keys, flat lists and their base64 form."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from services.gateway.logprob_fields import (
    decode_flat,
    decode_flat_b64,
    flat_top_fields,
    token_entries,
    top_entries,
)
from sglbus.logprobs import decode_flat_b64 as public_decode_flat_b64

P = "input_top_logprobs"


def _top(rows: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    # values with full float32 mantissas, so a lossy path (float16, decimal text) would show
    vals = -np.sort(rng.exponential(3.0, (rows, k)).astype(np.float32), axis=1)
    idx = rng.integers(0, 151936, (rows, k), dtype=np.int32)
    return vals, idx


def _roundtrip(fields: dict) -> dict:
    """What a client sees: the gateway's orjson bytes parsed by the stdlib."""
    return json.loads(orjson.dumps({"text": "x", "meta_info": fields}))["meta_info"]


def test_token_entries_values_ids_texts_and_null_first():
    vals = np.array([-0.5, -1.25, -3.0], dtype=np.float32)
    ids = np.array([7, 8, 9], dtype=np.int32)
    assert token_entries(vals, ids, None) == [[-0.5, 7, None], [-1.25, 8, None], [-3.0, 9, None]]
    got = token_entries(vals, ids, ["a", None, "c"], null_first=True)
    assert got == [[None, 7, "a"], [-1.25, 8, None], [-3.0, 9, "c"]]
    assert type(got[1][0]) is float and type(got[1][1]) is int  # Python scalars, not numpy
    assert token_entries(np.zeros(0, np.float32), np.zeros(0, np.int32), None, null_first=True) == []


def test_token_entries_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="vals"):
        token_entries(np.zeros(3, np.float32), np.zeros(2, np.int32), None)


def test_top_entries_null_prefix_then_rows_in_order():
    vals, idx = _top(4, 3)
    texts = [[f"t{r}{j}" for j in range(3)] for r in range(4)]
    got = top_entries(vals, idx, texts, null_prefix=2)
    assert len(got) == 6 and got[:2] == [None, None]
    for r in range(4):
        assert got[2 + r] == [[float(vals[r, j]), int(idx[r, j]), f"t{r}{j}"] for j in range(3)]
        assert [e[0] for e in got[2 + r]] == sorted((e[0] for e in got[2 + r]), reverse=True)
    assert top_entries(vals, idx, None, 0)[0][1][2] is None


def test_top_entries_k0_and_rows0():
    v0, i0 = np.zeros((3, 0), np.float32), np.zeros((3, 0), np.int32)
    assert top_entries(v0, i0, None, null_prefix=1) == [None, [], [], []]
    e0, ei = np.zeros((0, 2), np.float32), np.zeros((0, 2), np.int32)
    assert top_entries(e0, ei, None, null_prefix=2) == [None, None]


@pytest.mark.parametrize("rows,k,null_prefix", [(5, 2, 1), (3, 4, 0), (1, 1, 7)])
def test_flat_lists_position_rank_indexing(rows, k, null_prefix):
    vals, idx = _top(rows, k)
    meta = _roundtrip(flat_top_fields(P, vals, idx, null_prefix, b64=False))
    assert meta[f"{P}_shape"] == [rows, k] and meta[f"{P}_null_prefix"] == null_prefix
    flat_v, flat_i = meta[f"{P}_val_flat"], meta[f"{P}_idx_flat"]
    for i in range(null_prefix, null_prefix + rows):
        for j in range(k):
            at = (i - null_prefix) * k + j
            assert np.float32(flat_v[at]) == vals[i - null_prefix, j]
            assert flat_i[at] == idx[i - null_prefix, j]


def test_b64_roundtrip_bit_exact_and_equal_to_flat_lists():
    vals, idx = _top(257, 5, seed=3)
    vals[0, -1] = -np.inf  # a masked token: JSON numbers can't carry it, the bytes can
    flat = _roundtrip(flat_top_fields(P, vals, idx, 1, b64=False))
    b64 = _roundtrip(flat_top_fields(P, vals, idx, 1, b64=True))
    bv, bi = decode_flat_b64(b64, P)
    assert bv.dtype == np.float32 and bi.dtype == np.int32 and bv.shape == bi.shape == (257, 5)
    assert bv.tobytes() == vals.tobytes() and np.array_equal(bi, idx)
    fv, fi = decode_flat(flat, P)
    finite = np.isfinite(vals)
    assert fv[finite].tobytes() == bv[finite].tobytes() and np.array_equal(fi, bi)
    assert b64[f"{P}_shape"] == flat[f"{P}_shape"] == [257, 5]
    assert b64[f"{P}_null_prefix"] == flat[f"{P}_null_prefix"] == 1
    bv[0, 0] = 0.0  # the client may work in place


def test_b64_keys_replace_list_keys():
    vals, idx = _top(4, 2)
    fields = flat_top_fields(P, vals, idx, 1, b64=True)
    assert fields[f"{P}_val_flat_b64_dtype"] == "float32"
    assert fields[f"{P}_idx_flat_b64_dtype"] == "int32"
    assert isinstance(fields[f"{P}_val_flat_b64"], str) and isinstance(fields[f"{P}_idx_flat_b64"], str)
    assert f"{P}_val_flat" not in fields and f"{P}_idx_flat" not in fields
    assert set(flat_top_fields(P, vals, idx, 1, b64=False)) == {
        f"{P}_val_flat",
        f"{P}_idx_flat",
        f"{P}_shape",
        f"{P}_null_prefix",
    }


def test_b64_bytes_are_little_endian_float32_int32():
    vals = np.array([[-1.5, -2.0]], dtype=">f4")  # big-endian input still goes out little-endian
    idx = np.array([[1, 258]], dtype=np.int64)
    fields = flat_top_fields(P, vals, idx, 0, b64=True)
    import base64

    assert base64.b64decode(fields[f"{P}_val_flat_b64"]) == np.array([-1.5, -2.0], "<f4").tobytes()
    assert base64.b64decode(fields[f"{P}_idx_flat_b64"]) == b"\x01\x00\x00\x00\x02\x01\x00\x00"


@pytest.mark.parametrize("b64", [False, True])
@pytest.mark.parametrize("rows,k", [(0, 2), (3, 0), (0, 0)])
def test_empty_arrays_roundtrip(b64, rows, k):
    vals, idx = np.zeros((rows, k), np.float32), np.zeros((rows, k), np.int32)
    meta = _roundtrip(flat_top_fields(P, vals, idx, 1, b64=b64))
    v, i = (decode_flat_b64 if b64 else decode_flat)(meta, P)
    assert v.shape == i.shape == (rows, k) and meta[f"{P}_shape"] == [rows, k]


def test_decode_b64_checks_dtype_keys():
    vals, idx = _top(2, 2)
    fields = flat_top_fields(P, vals, idx, 0, b64=True)
    with pytest.raises(ValueError, match="val_flat_b64_dtype is 'float16'"):
        decode_flat_b64({**fields, f"{P}_val_flat_b64_dtype": "float16"}, P)
    with pytest.raises(ValueError, match="idx_flat_b64_dtype is None"):
        decode_flat_b64({k: v for k, v in fields.items() if k != f"{P}_idx_flat_b64_dtype"}, P)


def test_flat_top_fields_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rows, k"):
        flat_top_fields(P, np.zeros((2, 2), np.float32), np.zeros((2, 3), np.int32), 0, b64=True)
    with pytest.raises(ValueError, match="null_prefix"):
        flat_top_fields(P, np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int32), -1, b64=False)


def test_all_outputs_serialize_with_orjson():
    vals, idx = _top(3, 2)
    meta = {
        "input_token_logprobs": token_entries(vals[:, 0], idx[:, 0], ["a", "b", None], null_first=True),
        "input_top_logprobs": top_entries(vals, idx, None, 1),
        **flat_top_fields("output_top_logprobs", vals, idx, 0, b64=False),
        **flat_top_fields(P, vals, idx, 1, b64=True),
    }
    back = orjson.loads(orjson.dumps(meta))
    assert back["input_token_logprobs"][0] == [None, int(idx[0, 0]), "a"]
    assert back["input_top_logprobs"][0] is None and len(back["input_top_logprobs"]) == 4


def test_public_module_reexports():
    assert public_decode_flat_b64 is decode_flat_b64


def test_stdlib_base64_fallback_gives_same_payload(monkeypatch):
    # pybase64 is optional (a dev dependency); servers without it run the stdlib module
    import base64

    from services.gateway import logprob_fields

    vals, idx = _top(9, 3)
    fast = flat_top_fields(P, vals, idx, 1, b64=True)
    monkeypatch.setattr(logprob_fields, "_b64", base64)
    assert flat_top_fields(P, vals, idx, 1, b64=True) == fast
    v, i = decode_flat_b64(fast, P)
    assert v.tobytes() == vals.tobytes() and np.array_equal(i, idx)
