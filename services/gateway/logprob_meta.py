"""One request's logprobs at the gateway: raw arrays from the bus accumulate here, and `meta()` shapes
them into SGLang's `meta_info` keys: the whole request so far (SGLang's streaming chunks are
cumulative, like the text), or only the output rows from `start` on (the delta chunks of the OpenAI
streams). Either way a chunk builds only its new rows: the cumulative entries are kept and appended to
(as SGLang's tokenizer manager keeps them), the prompt's are built once, and a delta reads only the
bus parts that hold its rows. What a cumulative chunk must still copy and encode is its whole size."""

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
        self._sizes = dict.fromkeys(self._parts, 0)  # elements per key (the input side's: not shared)
        self._input: tuple[int, dict[str, Any]] | None = None  # (input elements, their meta keys)
        self._built: dict[str, Any] = {}  # the cumulative output keys, for rows 0 .. len(_built_ids)
        self._built_ids: list[int] = []  # the output ids those rows were built with

    def add(self, lp: LogprobOut) -> None:
        for key, parts in self._parts.items():
            data = getattr(lp, key)
            if data:
                parts.append(np.frombuffer(data, dtype=_FIELDS[key.split("_", 1)[1]]))
                self._sizes[key] += len(parts[-1])

    def share_input(self, other: LogprobAccumulator) -> None:
        """The prompt logprobs are those another request on the same prompt computes (n > 1 samples
        share their prefill's), read from it as they arrive."""
        for key, parts in other._parts.items():
            if key.startswith("input_"):
                self._parts[key] = parts

    def _array(self, key: str, width: int | None = None, start: int = 0) -> np.ndarray:
        """The rows of key from `start` on; an output key's from the parts that hold them only."""
        parts, w = self._parts[key], width or 1
        dtype = _FIELDS[key.split("_", 1)[1]]
        if start:
            left, tail = self._sizes[key] - start * w, []
            for p in reversed(parts):
                if left <= 0:
                    break
                tail.append(p[-left:] if len(p) > left else p)
                left -= len(p)
            parts = tail[::-1]
        a = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.empty(0, dtype))
        return a if width is None else a.reshape(-1, width)

    @property
    def output_rows(self) -> int:
        """Output positions with logprobs so far."""
        return self._sizes["output_token"]

    def meta(self, output_ids: list[int], start: int = 0, input_side: bool = True) -> dict[str, Any]:
        """The logprob keys of meta_info: the prompt side (unless input_side is False) and the output
        rows from `start` on. The values may be shared with later calls: read them, do not change them."""
        o = self.opts
        meta: dict[str, Any] = self._input_meta() if input_side else {}
        if start == 0 and self._aligned():
            meta.update(self._cumulative(output_ids))
            return meta
        # output side: one row per output token so far
        ids = np.asarray(output_ids[start : self.output_rows], dtype=np.int32)
        self._side(meta, "output", self._array("output_token", None, start), ids, 0, o.output_flat,
                   o.output_b64, start)  # fmt: skip
        return meta

    def _input_meta(self) -> dict[str, Any]:
        """The prompt side's keys, built again only when more of its rows arrived (prefill chunks).
        Prompt positions start_len .. len(prompt)-1; position 0 has nothing before it (null)."""
        size = sum(len(p) for p in self._parts["input_token"])  # a few parts: one per prefill chunk
        if self._input is not None and self._input[0] == size:
            return dict(self._input[1])
        o, meta = self.opts, {}
        first = o.start_len if 0 <= o.start_len < len(self.prompt) else len(self.prompt)
        null = 1 if first == 0 else 0
        tok = self._array("input_token")
        ids = np.asarray(self.prompt[first : first + null + len(tok)], dtype=np.int32)
        vals = np.concatenate((np.zeros(null, np.float32), tok)) if null else tok
        self._side(meta, "input", vals, ids, null, o.flat, o.flat_b64)
        self._input = (size, meta)
        return dict(meta)

    def _aligned(self) -> bool:
        """Every output array has one row per output token (not so when a prefill-only request has a
        top-k row for the next position and no token: then the cache is not used)."""
        rows, o = self.output_rows, self.opts
        return (not o.top_k or self._sizes["output_top_val"] == rows * o.top_k) and (
            not self.n_ids or self._sizes["output_ids_val"] == rows * self.n_ids
        )

    def _cumulative(self, output_ids: list[int]) -> dict[str, Any]:
        """The output side so far: the rows new since the last call are built and appended to those
        kept (all again if a retokenization changed ids already built); each list is copied, so what
        an earlier call returned stays as it was."""
        o, built, rows = self.opts, len(self._built_ids), self.output_rows
        if output_ids[:built] != self._built_ids:
            self._built, self._built_ids, built = {}, [], 0
        if rows > built or not self._built:
            new: dict[str, Any] = {}
            ids = np.asarray(output_ids[built:rows], dtype=np.int32)
            top = not o.output_b64  # the base64 strings are encoded whole, below
            self._side(new, "output", self._array("output_token", None, built), ids, 0, o.output_flat,
                       False, built, top)  # fmt: skip
            for key, value in new.items():
                if isinstance(value, list) and not key.endswith("_shape"):
                    self._built.setdefault(key, []).extend(value)
                else:
                    self._built[key] = value
            if o.output_flat and not o.output_b64 and o.top_k:
                self._built["output_top_logprobs_shape"] = [rows, o.top_k]
            self._built_ids = output_ids[:rows]
        meta = {k: list(v) if isinstance(v, list) and not k.endswith("_shape") else v
                for k, v in self._built.items()}  # fmt: skip
        if o.output_b64 and o.top_k:
            k = o.top_k
            top_val, top_idx = self._array("output_top_val", k), self._array("output_top_idx", k)
            meta.update(flat_top_fields("output_top_logprobs", top_val, top_idx, 0, True))
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
        top: bool = True,
    ) -> None:
        """start: the first row of `vals` among the side's rows (the top and token_ids arrays are cut
        from there); top: whether to add the top-k keys."""
        o, text_of = self.opts, self.text_of
        texts = text_of(ids.tolist()) if o.text else None
        meta[f"{side}_token_logprobs"] = token_entries(vals, ids, texts, null_first=bool(null))
        if o.top_k and top:
            top_val = self._array(f"{side}_top_val", o.top_k, start)
            top_idx = self._array(f"{side}_top_idx", o.top_k, start)
            if flat or b64:
                meta.update(flat_top_fields(f"{side}_top_logprobs", top_val, top_idx, null, b64))
            else:
                top_texts = None
                if o.text:
                    flat_texts = text_of(top_idx.ravel().tolist())
                    top_texts = [flat_texts[r * o.top_k : (r + 1) * o.top_k] for r in range(len(top_idx))]
                meta[f"{side}_top_logprobs"] = top_entries(top_val, top_idx, top_texts, null)
        if self.n_ids:
            ids_val = self._array(f"{side}_ids_val", self.n_ids, start)
            asked = np.broadcast_to(np.asarray(o.token_ids, dtype=np.int32), ids_val.shape)
            id_texts = None
            if o.text:
                names = text_of(list(o.token_ids))
                id_texts = [names] * len(ids_val)
            meta[f"{side}_token_ids_logprobs"] = top_entries(ids_val, asked, id_texts, null)
