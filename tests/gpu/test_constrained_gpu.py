"""Constrained decoding on CUDA (skipped without a GPU), with the GPU's defaults: overlap scheduling,
CUDA graphs, the triton backend. Every output of a mixed batch follows its grammar, with and without
jump-forward; no KV slot leaks (the engine fixture checks).

`SGLBUS_GPU_TEST_MODEL=<config-only folder>` runs it on random weights of a large shape
(`--load-format dummy`: the outputs are noise, but the grammar still holds them); by default it
runs on the default model."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("llguidance")

MODEL = os.environ.get("SGLBUS_GPU_TEST_MODEL")
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
     "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
     "maxItems": 3}, "ok": {"type": "boolean"}}, "required": ["tags", "ok"], "additionalProperties": False},
]  # fmt: skip
REGEX = r"\(\d{3}\) \d{3}-\d{4}"


def batch(n: int) -> tuple[list[str], list[dict]]:
    prompts, params = [], []
    for i in range(n):
        kind = i % 4
        p: dict = {"temperature": 0 if i % 2 else 0.8, "max_new_tokens": 96, "sampling_seed": i}
        if kind < 2:
            p["json_schema"] = json.dumps(SCHEMAS[kind])
        elif kind == 2:
            p["regex"] = REGEX
        else:
            p.update(max_new_tokens=24, ignore_eos=True)
        prompts.append(f"Request {i}: answer in the asked format:")
        params.append(p)
    return prompts, params


def check(outs, params) -> None:
    for o, p in zip(outs, params, strict=True):
        reason = o["meta_info"]["finish_reason"]
        if "json_schema" in p:
            assert reason["type"] == "stop", o
            obj = json.loads(o["text"])
            assert set(obj) == set(json.loads(p["json_schema"])["required"]), o["text"]
        elif "regex" in p:
            assert reason["type"] == "stop" and re.fullmatch(REGEX, o["text"]), o
        else:
            assert o["meta_info"]["completion_tokens"] == 24


@pytest.mark.parametrize("jump_forward", [True, False])
def test_mixed_batches_hold_their_grammars(make_engine, jump_forward):
    opts = {"model_path": MODEL, "load_format": "dummy"} if MODEL else {}
    engine = make_engine(device="cuda", max_total_tokens=65536, disable_jump_forward=not jump_forward, **opts)
    prompts, params = batch(256)
    check(engine.generate(prompts, params), params)
    assert (engine.get_stats()["jump_forward_tokens"] > 0) == jump_forward
