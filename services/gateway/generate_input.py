"""SGLang's `GenerateReqInput`: one prompt or a batch, as text or token ids, turned into a list of
prompts with their own sampling parameters and request ids."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from shared.sampling_params import SamplingParams

KNOWN_FIELDS = ("text", "input_ids", "sampling_params", "rid", "stream")


@dataclass
class Prompt:
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams


@dataclass
class GenerateInput:
    prompts: list[Prompt]
    is_batch: bool
    stream: bool


def parse_generate_input(obj: dict[str, Any]) -> GenerateInput:
    """Raises ValueError with a message naming the field."""
    if not isinstance(obj, dict):
        raise ValueError("the request body must be a JSON object")
    unsupported = sorted(k for k, v in obj.items() if k not in KNOWN_FIELDS and v not in (None, False))
    if unsupported:
        raise ValueError(
            f"field(s) not supported yet: {', '.join(unsupported)}; supported: {', '.join(KNOWN_FIELDS)}"
        )
    text, ids = obj.get("text"), obj.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("exactly one of text and input_ids must be given")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ValueError("text must be a non-empty string or a non-empty list of non-empty strings")
        items: list[tuple[str | None, list[int] | None]] = [(t, None) for t in texts]
    else:
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        rows = ids if is_batch else [ids]
        if not rows or not all(
            isinstance(r, list) and r and all(isinstance(t, int) for t in r) for r in rows
        ):
            raise ValueError("input_ids must be a non-empty list of ints or a non-empty list of such lists")
        items = [(None, r) for r in rows]
    n = len(items)
    sp = obj.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != n:
            raise ValueError(f"sampling_params has {len(sp)} entries for {n} prompts")
        params = [SamplingParams.from_dict(p) for p in sp]
    else:
        params = [SamplingParams.from_dict(sp)] * n
    rid = obj.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, list):
        if len(rid) != n or not all(isinstance(r, str) for r in rid):
            raise ValueError(f"rid must be a string or a list of {n} strings")
        rids = rid
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    else:
        raise ValueError("rid must be a string or a list of strings")
    prompts = [Prompt(r, t, i, p) for r, (t, i), p in zip(rids, items, params, strict=True)]
    return GenerateInput(prompts, is_batch, bool(obj.get("stream", False)))
