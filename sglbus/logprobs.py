"""Client-side readers for the flat prompt top-logprob arrays in a `/generate` response's meta_info.

from sglbus.logprobs import decode_flat_b64
vals, idx = decode_flat_b64(resp["meta_info"], "input_top_logprobs")  # (rows, k) float32, int32
# position i, rank j: vals[i - meta_info["input_top_logprobs_null_prefix"], j]
"""

from __future__ import annotations

from services.gateway.logprob_fields import decode_flat, decode_flat_b64

__all__ = ["decode_flat", "decode_flat_b64"]
