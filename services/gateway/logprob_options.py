"""The logprob fields of `GenerateReqInput`: parsed per prompt (a scalar applies to every prompt of a
batch, a list gives one value per prompt), validated with messages naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.messages import LogprobReq

# request fields this module reads, and their defaults
FIELDS = {
    "return_logprob": False,
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    # beyond upstream: output_top_logprobs as flat base64 arrays too
    "return_output_top_logprobs_b64": False,
}
# Per position. SGLang has no cap; OpenAI's is 20 (chat) and 5 (completions), which ours keeps on /v1.
# Distillation and RL ask /generate for a few hundred (the flat base64 form is for them); more is a
# full-vocabulary dump, not a top-k, and costs the bus and every streamed chunk that much per token.
MAX_TOP_LOGPROBS = 1024
# token_ids_logprob: the same cost per position as top_logprobs_num, so the same cap. SGLang does not
# say what duplicates mean (it would return the same id twice): refused, as a client's mistake.
MAX_TOKEN_IDS_LOGPROB = MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class LogprobOptions:
    start_len: int  # -1: output logprobs only
    top_k: int
    token_ids: list[int] | None
    text: bool  # return_text_in_logprobs
    flat: bool  # input_top_logprobs as flat arrays
    flat_b64: bool  # ... base64-encoded
    output_b64: bool  # output_top_logprobs as flat base64 arrays
    input_shared: bool = False  # the prompt side comes from another request (n > 1): ask for output only
    output_flat: bool = False  # output_top_logprobs as flat arrays (base64 when output_b64)

    def request(self) -> LogprobReq:
        start = -1 if self.input_shared else self.start_len
        return LogprobReq(start_len=start, top_k=self.top_k, token_ids=self.token_ids or [])


def parse_logprob_options(obj: dict[str, Any], n: int) -> list[LogprobOptions | None]:
    """One entry per prompt: None where the prompt did not ask for logprobs."""
    want = _per_prompt(obj, "return_logprob", n, _bool)
    start = _per_prompt(obj, "logprob_start_len", n, _start_len)
    top = _per_prompt(obj, "top_logprobs_num", n, _top_k)
    ids = _token_ids(obj.get("token_ids_logprob"), n)
    text = _bool("return_text_in_logprobs", _scalar(obj, "return_text_in_logprobs"))
    flat = _bool("return_flat_raw_top_logprobs", _scalar(obj, "return_flat_raw_top_logprobs"))
    out_flat = _bool(
        "return_flat_raw_output_top_logprobs", _scalar(obj, "return_flat_raw_output_top_logprobs")
    )
    b64 = _bool("return_flat_raw_top_logprobs_b64", _scalar(obj, "return_flat_raw_top_logprobs_b64"))
    out_b64 = _bool("return_output_top_logprobs_b64", _scalar(obj, "return_output_top_logprobs_b64"))
    if b64 and not (flat or out_flat):
        raise ValueError("return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs or "
                         "return_flat_raw_output_top_logprobs")  # fmt: skip
    if not any(want):
        asked = [k for k, v in (("top_logprobs_num", any(top)), ("token_ids_logprob", any(ids)),
                                ("return_flat_raw_top_logprobs", flat),
                                ("return_flat_raw_output_top_logprobs", out_flat),
                                ("return_output_top_logprobs_b64", out_b64)) if v]  # fmt: skip
        if asked:
            raise ValueError(f"{', '.join(asked)} need(s) return_logprob: true")
        return [None] * n
    # b64 applies to each side that is flat (SGLang's rule); return_output_top_logprobs_b64 alone is both
    in_b64, out_b64 = flat and b64, out_b64 or (out_flat and b64)
    return [
        LogprobOptions(s, k, i, text, flat, in_b64, out_b64, output_flat=out_flat or out_b64) if w else None
        for w, s, k, i in zip(want, start, top, ids, strict=True)
    ]


def _scalar(obj: dict[str, Any], key: str) -> Any:
    value = obj.get(key)
    return FIELDS[key] if value is None else value


def _per_prompt(obj: dict[str, Any], key: str, n: int, check) -> list:
    value = obj.get(key)
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{key} is a list of {len(value)} for {n} prompts; give one per prompt")
        return [check(key, FIELDS[key] if v is None else v) for v in value]
    return [check(key, FIELDS[key] if value is None else value)] * n


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false")
    return v


def _start_len(key: str, v: Any) -> int:
    if not _is_int(v) or v < -1:
        raise ValueError(f"{key} = {v!r} is invalid; allowed: -1 (output only) or a prompt position >= 0")
    return v


def _top_k(key: str, v: Any) -> int:
    if not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{key} = {v!r} is invalid; allowed: integers in [0, {MAX_TOP_LOGPROBS}]")
    return v


def _token_ids(value: Any, n: int) -> list[list[int] | None]:
    """A list of ids for every prompt, or a list of such lists (one per prompt)."""
    if value is None:
        return [None] * n
    if not isinstance(value, list):
        raise ValueError("token_ids_logprob must be a list of token ids or a list of such lists")
    if value and all(isinstance(v, list) or v is None for v in value):
        if len(value) != n:
            raise ValueError(f"token_ids_logprob has {len(value)} lists for {n} prompts; give one per prompt")
        return [None if v is None else _ids(v) for v in value]
    return [_ids(value)] * n


def _ids(v: list) -> list[int] | None:
    if len(v) > MAX_TOKEN_IDS_LOGPROB:
        raise ValueError(f"token_ids_logprob: at most {MAX_TOKEN_IDS_LOGPROB} token ids per prompt, "
                         f"got {len(v)}")  # fmt: skip
    if not all(_is_int(t) for t in v):
        raise ValueError("token_ids_logprob must contain integer token ids")
    seen: set[int] = set()
    for t in v:
        if t in seen:
            raise ValueError(f"token_ids_logprob: each token id at most once, got {t} more than once")
        seen.add(t)
    return v or None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
