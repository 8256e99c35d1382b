"""Shape per-request logprob arrays into SGLang `meta_info` keys (see SGLANG_API.md, "Logprobs").

The gateway receives logprobs from the bus as numpy arrays; everything here stays vectorised until the
one `.tolist()` that JSON needs, and the base64 form skips even that (a memcpy plus base64).

Top-k arrays hold only the non-null positions: `vals`/`idx` have shape (rows, k) and `null_prefix`
positions (nothing precedes the first prompt token; a prefix cache hit adds more) come before them:

    position:  0 ... null_prefix-1 | null_prefix ... null_prefix+rows-1
    entry:     None      None      | vals[0]   ...   vals[rows-1]

so position i, rank j sits at row i - null_prefix, and at flat[(i - null_prefix) * k + j].

`decode_flat` and `decode_flat_b64` are the client side (re-exported by `sglbus.logprobs`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:  # several times faster than the stdlib at these sizes (a dependency); the stdlib is the fallback
    import pybase64 as _b64
except ImportError:
    import base64 as _b64

BASE64_MODULE: str = _b64.__name__  # which one encodes and decodes here ("pybase64" or "base64")

Entry = list[Any]  # [logprob | None, token_id, text | None]

_VAL_DTYPE, _IDX_DTYPE = "float32", "int32"


def token_entries(
    vals: np.ndarray, ids: np.ndarray, texts: list[str | None] | None, null_first: bool = False
) -> list[Entry]:
    """`[[logprob, token_id, text_or_None], ...]`, one per position; with `null_first` the first
    logprob is None (the first prompt position has nothing before it)."""
    if vals.shape != ids.shape or vals.ndim != 1:
        raise ValueError(f"token logprobs: vals {vals.shape} and ids {ids.shape} must be equal 1-D shapes")
    v, i = vals.tolist(), ids.tolist()
    if null_first and v:
        v[0] = None
    if texts is None:
        return [[a, b, None] for a, b in zip(v, i, strict=True)]
    return [[a, b, t] for a, b, t in zip(v, i, texts, strict=True)]


def top_entries(
    vals: np.ndarray, idx: np.ndarray, texts: list[list[str | None]] | None, null_prefix: int
) -> list[list[Entry] | None]:
    """One entry per position: `null_prefix` Nones, then per row its k `[logprob, id, text]`, best
    first (the order of the row). k == 0 gives [] for each non-null position."""
    _check_top(vals, idx, null_prefix)
    out: list[list[Entry] | None] = [None] * null_prefix
    v, i = vals.tolist(), idx.tolist()
    if texts is None:
        out.extend([[a, b, None] for a, b in zip(vr, ir, strict=True)] for vr, ir in zip(v, i, strict=True))
    else:
        out.extend(
            [[a, b, t] for a, b, t in zip(vr, ir, tr, strict=True)]
            for vr, ir, tr in zip(v, i, texts, strict=True)
        )
    return out


def flat_top_fields(
    prefix: str, vals: np.ndarray, idx: np.ndarray, null_prefix: int, b64: bool
) -> dict[str, Any]:
    """The flat form of a top-k array under `prefix` (e.g. "input_top_logprobs"): `{prefix}_val_flat`,
    `{prefix}_idx_flat` (row-major lists), or with `b64` their float32/int32 little-endian bytes in
    base64 (`..._flat_b64`) with `..._flat_b64_dtype` keys; plus `{prefix}_shape` [rows, k] and
    `{prefix}_null_prefix`."""
    _check_top(vals, idx, null_prefix)
    fields: dict[str, Any] = {}
    if b64:
        val_bytes = np.ascontiguousarray(vals, dtype="<f4").tobytes()
        idx_bytes = np.ascontiguousarray(idx, dtype="<i4").tobytes()
        fields[f"{prefix}_val_flat_b64"] = _b64.b64encode(val_bytes).decode("ascii")
        fields[f"{prefix}_idx_flat_b64"] = _b64.b64encode(idx_bytes).decode("ascii")
        fields[f"{prefix}_val_flat_b64_dtype"] = _VAL_DTYPE
        fields[f"{prefix}_idx_flat_b64_dtype"] = _IDX_DTYPE
    else:
        # via float32 so both forms carry the same values (a float64 input is rounded either way)
        fields[f"{prefix}_val_flat"] = np.asarray(vals, dtype=np.float32).ravel().tolist()
        fields[f"{prefix}_idx_flat"] = np.asarray(idx, dtype=np.int32).ravel().tolist()
    fields[f"{prefix}_shape"] = [int(vals.shape[0]), int(vals.shape[1])]
    fields[f"{prefix}_null_prefix"] = int(null_prefix)
    return fields


def decode_flat_b64(meta: dict, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(vals float32 (rows, k), idx int32 (rows, k)) from the base64 keys of `meta` (a meta_info);
    writable arrays in native byte order."""
    for kind, want in (("val", _VAL_DTYPE), ("idx", _IDX_DTYPE)):
        got = meta.get(f"{prefix}_{kind}_flat_b64_dtype")
        if got != want:
            raise ValueError(f"{prefix}_{kind}_flat_b64_dtype is {got!r}; this client reads {want!r}")
    rows, k = meta[f"{prefix}_shape"]
    # astype copies: native order, and writable (frombuffer over bytes is read-only)
    vals = np.frombuffer(_b64.b64decode(meta[f"{prefix}_val_flat_b64"]), dtype="<f4").astype(np.float32)
    idx = np.frombuffer(_b64.b64decode(meta[f"{prefix}_idx_flat_b64"]), dtype="<i4").astype(np.int32)
    return vals.reshape(rows, k), idx.reshape(rows, k)


def decode_flat(meta: dict, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(vals float32 (rows, k), idx int32 (rows, k)) from the list keys of `meta`."""
    rows, k = meta[f"{prefix}_shape"]
    vals = np.asarray(meta[f"{prefix}_val_flat"], dtype=np.float32)
    idx = np.asarray(meta[f"{prefix}_idx_flat"], dtype=np.int32)
    return vals.reshape(rows, k), idx.reshape(rows, k)


def _check_top(vals: np.ndarray, idx: np.ndarray, null_prefix: int) -> None:
    if vals.shape != idx.shape or vals.ndim != 2:
        raise ValueError(f"top logprobs: vals {vals.shape} and idx {idx.shape} must be equal (rows, k)")
    if null_prefix < 0:
        raise ValueError(f"top logprobs: null_prefix must be >= 0, got {null_prefix}")
