"""The abuse benchmark's payloads are the attacks issue 34 names, and each is past the cap whose 400
the benchmark expects to name (no server: the payloads and the gateway's own checks only)."""

from __future__ import annotations

import json

import orjson
import pytest

from benchmarks.abuse import dag_schema, deep_json, grammar_bodies, huge_lists, last_event, states_bomb
from services.gateway.generate_input import decode_json, parse_generate_input
from shared.grammar_limits import check_schema_cost


def test_the_states_bomb_is_a_mebibyte_of_250000_prompts_times_128():
    body = states_bomb()
    assert 0.9 < len(body) / (1 << 20) < 1.0  # under the body parser's child threshold: parsed in place
    obj = orjson.loads(body)
    assert len(obj["text"]) * obj["sampling_params"]["n"] == 32_000_000


@pytest.mark.parametrize("name", list(huge_lists()))
def test_each_huge_list_is_refused_naming_its_cap(name):
    path, body, names = huge_lists()[name]
    assert path == "/generate"
    with pytest.raises(ValueError, match=names):
        req = parse_generate_input(orjson.loads(body))
        for p in req.prompts:
            p.sampling.verify(49152)


def test_the_dag_schema_is_small_and_past_the_expansion_bound():
    text = dag_schema(40)
    assert 4000 < len(text) < 6000
    assert json.loads(text)["$defs"]["L0"]["properties"]["a"] == {"$ref": "#/$defs/L1"}
    with pytest.raises(ValueError, match=grammar_bodies()["json_schema $ref DAG x40"][2]):
        check_schema_cost(text)


def test_the_deep_body_nests_100000_levels_and_does_not_parse():
    body = deep_json()
    assert body.count(b"[") == 100_000 and body.count(b"]") == 100_000
    with pytest.raises(ValueError):
        decode_json(body)


def test_last_event_reads_the_final_sse_chunk():
    last = b'data: {"text": "ab", "meta_info": {"finish_reason": {"type": "length"}}}\n\n'
    sse = b'data: {"text": "a"}\n\n' + last
    assert last_event(sse + b"data: [DONE]\n\n")["meta_info"]["finish_reason"]["type"] == "length"
    assert last_event(b"") == {}
