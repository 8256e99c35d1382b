"""Grammars through the served system (gateway, scheduler and detokenizer processes over NATS): a
streamed JSON schema with jump-forward (retokenized ids replace earlier ones on the bus, the text
only grows), the bus API with a regex and its 400 for a bad one, stop_regex, and the 400s for grammars
that cannot be decoded (no finite string, a schema false, keywords xgrammar would ignore)."""

from __future__ import annotations

import json
import re

import httpx
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


def test_grammars_that_cannot_be_decoded_are_400s_and_the_odd_good_ones_work(client):
    """A grammar with no finite string (its jump-forward looped until the server was killed: with
    return_logprob, which turns jump-forward off, it decoded "aaaa"), a schema false, a keyword the
    default backend (xgrammar) would ignore: 400s naming the problem. A schema true and a multi-line
    EBNF alternation (the early check refused it) decode."""

    def post(grammar: dict) -> httpx.Response:
        body = {"text": "Answer:", "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 24, **grammar}}  # fmt: skip
        return client.post("/generate", json=body)

    endless = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
    ignored = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$", "maxLength": 3}}}
    for grammar, why in [
        ({"ebnf": 'root ::= "a" root'}, "the grammar accepts no finite string (rule root never ends)"),
        ({"ebnf": 'root ::= "a" | "b" x\nx ::= "c" x'}, "rule x never ends"),
        ({"json_schema": json.dumps(endless)}, "the schema admits no finite JSON value"),
        ({"regex": r"[^\s\S]"}, "the regex accepts no string"),
        ({"json_schema": "false"}, "the schema false admits no value"),
        ({"json_schema": json.dumps(ignored)}, "maxLength beside pattern at /properties/s is not supported"),
    ]:
        r = post(grammar)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (grammar, r.text)
    assert isinstance(json.loads(post({"json_schema": "true"}).json()["text"]), (dict, list, str, int, float))
    out = post({"ebnf": 'root ::=\n    "a"\n    | "b"\n    | "c"'}).json()
    assert out["text"] in ("a", "b", "c"), out
