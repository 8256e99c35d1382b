"""A JSON schema's cost is bounded before any grammar library expands it: $refs reusing definitions
down a chain (a DAG whose expansion doubles per level), deep nesting and huge texts are refused with
the bound named; ordinary and recursive schemas pass."""

from __future__ import annotations

import json

import pytest

from shared.grammar_limits import MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, check_schema_cost
from shared.grammar_text import check_grammar


def dag(levels: int) -> str:
    defs = {f"L{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/L{i + 1}"},
            "b": {"$ref": f"#/$defs/L{i + 1}"}}, "required": ["a", "b"]} for i in range(levels)}  # fmt: skip
    defs[f"L{levels}"] = {"type": "string", "maxLength": 3}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/L0"})


def test_a_dag_of_refs_is_refused_at_once_naming_the_bound():
    text = dag(40)
    assert len(text) < 6000
    with pytest.raises(
        ValueError, match=f"at most {MAX_SCHEMA_NODES} schema nodes with every \\$ref expanded"
    ):
        check_grammar("json_schema", text)


def test_a_small_dag_ordinary_and_recursive_schemas_pass():
    check_grammar("json_schema", dag(4))
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    check_grammar("json_schema", json.dumps(person))
    linked = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
              "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}},
              "$ref": "#/$defs/node"}  # fmt: skip
    check_schema_cost(json.dumps(linked))


def test_deep_nesting_and_huge_texts_are_refused():
    deep = (
        '{"type":"array","items":' * (MAX_SCHEMA_DEPTH + 1)
        + '{"type":"string"}'
        + "}" * (MAX_SCHEMA_DEPTH + 1)
    )
    with pytest.raises(ValueError, match=f"nested at most {MAX_SCHEMA_DEPTH} deep"):
        check_grammar("json_schema", deep)
    broken = "[" * 100_000  # not even JSON: still refused by its depth, not by a RecursionError
    with pytest.raises(ValueError, match="nested at most"):
        check_schema_cost(broken)
    huge = json.dumps({"type": "string", "description": "x" * MAX_SCHEMA_CHARS})
    with pytest.raises(ValueError, match=f"at most {MAX_SCHEMA_CHARS} characters"):
        check_grammar("json_schema", huge)
