"""Grammars through the served system (gateway, scheduler and detokenizer processes over NATS): a
streamed JSON schema with jump-forward (retokenized ids replace earlier ones on the bus, the text
only grows), the bus API with a regex and its 400 for a bad one, and stop_regex."""

from __future__ import annotations

import json
import re

import orjson
from it_helpers import generate, stream

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
          "additionalProperties": False}  # fmt: skip
BODY = {"text": "Alice is 31. As JSON:", "sampling_params": {"temperature": 0, "max_new_tokens": 48,
        "json_schema": json.dumps(SCHEMA)}}  # fmt: skip


def test_a_streamed_json_schema_holds_and_its_text_only_grows(client, tokenizer):
    chunks = stream(client, BODY)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"]), (a["text"], b["text"])
    last = chunks[-1]
    obj = json.loads(last["text"])
    assert set(obj) == {"name", "age"} and last["meta_info"]["finish_reason"]["type"] == "stop"
    assert tokenizer.decode(last["output_ids"], skip_special_tokens=True) == last["text"]
    whole = generate(client, BODY)
    assert (whole["text"], whole["output_ids"]) == (last["text"], last["output_ids"])


def test_the_bus_api_takes_a_regex_and_refuses_a_bad_one(srv):
    import asyncio

    import nats

    async def ask(body):
        nc = await nats.connect(srv.nats_url, token=srv.nats_token)
        try:
            return orjson.loads(
                (await nc.request("sglbus.api.generate", orjson.dumps(body), timeout=60)).data
            )
        finally:
            await nc.close()

    phone = r"\(\d{3}\) \d{3}-\d{4}"
    out = asyncio.run(ask({"text": "Call me at", "sampling_params": {"max_new_tokens": 20, "regex": phone}}))
    assert re.fullmatch(phone, out["text"]), out
    bad = asyncio.run(ask({"text": "x", "sampling_params": {"regex": "[0-9"}}))
    assert bad["error"]["code"] == 400 and "sampling_params.regex is invalid" in bad["error"]["message"]


def test_stop_regex_cuts_the_output_at_its_match(client):
    body = {"text": "Count: 1, 2, 3, 4,", "sampling_params": {"temperature": 0, "max_new_tokens": 32,
            "ignore_eos": True, "stop_regex": [r"\d\d"]}}  # fmt: skip
    out = generate(client, body)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and re.fullmatch(r"\d\d", reason["matched"]), out
    assert reason["matched"] not in out["text"] and not re.search(r"\d\d", out["text"])
    last = stream(client, body)[-1]
    assert (last["text"], last["meta_info"]["finish_reason"]) == (out["text"], reason)
