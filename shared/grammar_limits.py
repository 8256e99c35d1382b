"""Bounds on a JSON schema's cost, checked before any grammar library sees it. A schema's text is small,
but `$ref`s that point at the same definition more than once form a DAG whose expansion doubles per
level: 5.6 KB with a 40-level chain kept the gateway's grammar check busy for over a minute. So a schema
is refused (400, naming the bound) when its text, its nesting, or its size with every `$ref` expanded
(counted once per use, recursion counted once) is past these."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from shared.grammar_schema import pointer

MAX_SCHEMA_CHARS = 256 * 1024
MAX_SCHEMA_DEPTH = 128  # nested objects / arrays in the schema's JSON
MAX_SCHEMA_NODES = 50_000  # schema nodes with every $ref expanded where it is used

_WHERE = "sampling_params.json_schema"


def check_schema_cost(text: str) -> None:
    """ValueError naming the bound a schema is past; nothing for one within them (or not JSON: the
    grammar check says what is wrong with it)."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{_WHERE}: at most {MAX_SCHEMA_CHARS} characters, got {len(text)}")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        if _depth_of_text(text) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{_WHERE}: nested at most {MAX_SCHEMA_DEPTH} deep") from None
        return
    if _depth_of_text(text) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{_WHERE}: nested at most {MAX_SCHEMA_DEPTH} deep")
    nodes = _expanded_size(schema)
    if nodes > MAX_SCHEMA_NODES:
        raise ValueError(
            f"{_WHERE}: at most {MAX_SCHEMA_NODES} schema nodes with every $ref expanded where it is used, "
            f"got more ({'over 10^9' if nodes >= 10**9 else nodes}): $refs that reuse definitions many "
            "levels deep multiply"
        )


def _depth_of_text(text: str) -> int:
    """The deepest nesting of [ and { outside strings (without parsing: a deep text cannot crash it)."""
    depth = most = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped = not escaped and ch == "\\"
            if ch == '"' and not escaped:
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth -= 1
    return most


def _expanded_size(schema: Any) -> int:
    """Nodes of the schema with each local `$ref` ("#/...") replaced by its target, memoised per
    target, capped at 10^9; a $ref met again inside its own expansion (recursion) counts 1."""
    cap = 10**9

    active: set[str] = set()

    @cache
    def ref_size(ref: str) -> int:
        if ref in active:  # recursion: the grammar refers back, it is not expanded again
            return 1
        active.add(ref)
        try:
            t = pointer(schema, ref)
            return 1 if t is None else size(t)
        finally:
            active.discard(ref)

    def size(node: Any) -> int:
        if isinstance(node, dict):
            total = 1
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                    total += ref_size(v)
                elif k not in ("$defs", "definitions"):
                    total += size(v)
                if total >= cap:
                    return cap
            return total
        if isinstance(node, list):
            return min(cap, 1 + sum(size(v) for v in node))
        return 1

    return size(schema)
