"""One request's logprobs at the gateway: raw arrays from the bus accumulate here, and `meta()` shapes
them into SGLang's `meta_info` keys: the whole request so far (SGLang's streaming chunks are
cumulative, like the text), or only the output rows from `start` on (the delta chunks of the OpenAI
streams: each chunk costs its new rows, not the whole output again)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from services.gateway.logprob_fields import flat_top_fields, token_entries, top_entries
from services.gateway.logprob_options import LogprobOptions
from shared.messages import LogprobOut

_FIELDS = {"token": "<f4", "top_val": "<f4", "top_idx": "<i4", "ids_val": "<f4"}


class LogprobAccumulator:
    def __init__(
        self, opts: LogprobOptions, prompt_ids: list[int], text_of: Callable[[list[int]], list[str]]
    ) -> None:
        """text_of: each token's text alone, for return_text_in_logprobs."""
        self.opts, self.prompt, self.text_of = opts, prompt_ids, text_of
        self.n_ids = len(opts.token_ids or ())
        self._parts: dict[str, list[np.ndarray]] = {
            f"{side}_{name}": [] for side in ("input", "output") for name in _FIELDS
        }

    def add(self, lp: LogprobOut) -> None:
        for key, parts in self._parts.items():
            data = getattr(lp, key)
            if data:
                parts.append(np.frombuffer(data, dtype=_FIELDS[key.split("_", 1)[1]]))

    def share_input(self, other: LogprobAccumulator) -> None:
        """The prompt logprobs are those another request on the same prompt computes (n > 1 samples
        share their prefill's), read from it as they arrive."""
        for key, parts in other._parts.items():
            if key.startswith("input_"):
                self._parts[key] = parts

    def _array(self, key: str, width: int | None = None) -> np.ndarray:
        parts = self._parts[key]
        dtype = _FIELDS[key.split("_", 1)[1]]
        a = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.empty(0, dtype))
        return a if width is None else a.reshape(-1, width)

    @property
    def output_rows(self) -> int:
        """Output positions with logprobs so far."""
        return sum(len(p) for p in self._parts["output_token"])

    def meta(self, output_ids: list[int], start: int = 0, input_side: bool = True) -> dict[str, Any]:
        """The logprob keys of meta_info: the prompt side (unless input_side is False) and the output
        rows from `start` on."""
        o = self.opts
        meta: dict[str, Any] = {}
        if input_side:  # prompt positions start_len .. len(prompt)-1; position 0 has nothing before it (null)
            first = o.start_len if 0 <= o.start_len < len(self.prompt) else len(self.prompt)
            null = 1 if first == 0 else 0
            tok = self._array("input_token")
            ids = np.asarray(self.prompt[first : first + null + len(tok)], dtype=np.int32)
            vals = np.concatenate((np.zeros(null, np.float32), tok)) if null else tok
            self._side(meta, "input", vals, ids, null, o.flat, o.flat_b64)
        # output side: one row per output token so far
        tok = self._array("output_token")
        ids = np.asarray(output_ids[start : len(tok)], dtype=np.int32)
        self._side(meta, "output", tok[start:], ids, 0, o.output_flat, o.output_b64, start)
        return meta

    def _side(
        self,
        meta: dict[str, Any],
        side: str,
        vals: np.ndarray,
        ids: np.ndarray,
        null: int,
        flat: bool,
        b64: bool,
        start: int = 0,
    ) -> None:
        """start: the first row of `vals` among the side's rows (the top and token_ids arrays are cut
        from there)."""
        o, text_of = self.opts, self.text_of
        texts = text_of(ids.tolist()) if o.text else None
        meta[f"{side}_token_logprobs"] = token_entries(vals, ids, texts, null_first=bool(null))
        if o.top_k:
            top_val = self._array(f"{side}_top_val", o.top_k)[start:]
            top_idx = self._array(f"{side}_top_idx", o.top_k)[start:]
            if flat or b64:
                meta.update(flat_top_fields(f"{side}_top_logprobs", top_val, top_idx, null, b64))
            else:
                top_texts = None
                if o.text:
                    flat_texts = text_of(top_idx.ravel().tolist())
                    top_texts = [flat_texts[r * o.top_k : (r + 1) * o.top_k] for r in range(len(top_idx))]
                meta[f"{side}_top_logprobs"] = top_entries(top_val, top_idx, top_texts, null)
        if self.n_ids:
            ids_val = self._array(f"{side}_ids_val", self.n_ids)[start:]
            asked = np.broadcast_to(np.asarray(o.token_ids, dtype=np.int32), ids_val.shape)
            id_texts = None
            if o.text:
                names = text_of(list(o.token_ids))
                id_texts = [names] * len(ids_val)
            meta[f"{side}_token_ids_logprobs"] = top_entries(ids_val, asked, id_texts, null)
