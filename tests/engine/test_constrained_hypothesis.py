"""Every constrained output follows its grammar: hypothesis draws JSON schemas and regexes, the engine
decodes them greedily and sampled, with jump-forward on (the module engine) and off, and each
finished output must validate: a JSON schema checked by `conforms` below, a regex by `re.fullmatch`
(the drawn patterns mean the same in Python and in llguidance's Rust regex)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")

NAMES = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
scalars = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(
        lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
        st.integers(-50, 50),
        st.integers(0, 200),
    ),  # fmt: skip
    st.just({"type": "boolean"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(NAMES, min_size=1, max_size=3, unique=True)),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3)),
        st.builds(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            },
            st.dictionaries(NAMES, inner, min_size=1, max_size=3),
        ),  # fmt: skip
    ),
    max_leaves=5,
)
schemas = st.builds(
    lambda props: {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    },
    st.dictionaries(NAMES, values, min_size=1, max_size=3),
)

atoms = st.one_of(
    st.sampled_from([r"\d", "[a-z]", "[A-Z]", "[0-9a-f]", "x", "-", r"\.", " "]),
    st.builds(lambda a, b: f"({a}|{b})", NAMES, NAMES),
)
pieces = st.builds(lambda a, q: a + q, atoms, st.sampled_from(["", "?", "{1,3}", "{2}", "{0,2}"]))
regexes = st.lists(pieces, min_size=1, max_size=5).map("".join)


def conforms(value: Any, schema: dict) -> bool:
    """JSON schema validation for what `schemas` draws."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(conforms(v, schema["items"]) for v in value)
        )
    props = schema["properties"]
    return (
        isinstance(value, dict)
        and set(value) == set(props)
        and all(conforms(value[k], props[k]) for k in props)
    )


PARAMS = [
    {"temperature": 0, "max_new_tokens": 160},
    {"temperature": 1.0, "max_new_tokens": 160, "sampling_seed": 7},
]
HYPOTHESIS = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def check_json(outs, schema) -> None:
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", (o["text"], schema)
        assert conforms(json.loads(o["text"]), schema), (o["text"], schema)


@HYPOTHESIS
@given(schema=schemas)
def test_json_schema_outputs_validate(engine, schema):
    prompts = [f"Some data as JSON ({', '.join(schema['properties'])}):"] * 2
    check_json(engine.generate(prompts, [{**p, "json_schema": json.dumps(schema)} for p in PARAMS]), schema)


@HYPOTHESIS
@given(pattern=regexes)
def test_regex_outputs_match(engine, pattern):
    outs = engine.generate(["Write it:"] * 2, [{**p, "regex": pattern} for p in PARAMS])
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop" and re.fullmatch(pattern, o["text"]), (
            o,
            pattern,
        )


@pytest.fixture(scope="module")
def no_jump():
    from sglbus import Engine

    e = Engine(disable_jump_forward=True)
    yield e
    e.check_integrity()
    e.shutdown()


@settings(max_examples=2, deadline=None)
@given(schema=schemas)
def test_json_schema_outputs_validate_without_jump_forward(no_jump, schema):
    outs = no_jump.generate(["JSON:"] * 2, [{**p, "json_schema": json.dumps(schema)} for p in PARAMS])
    check_json(outs, schema)
