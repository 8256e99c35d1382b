"""Bounds on a grammar's cost, checked before any grammar library sees it. A schema's text is small,
but `$ref`s that point at the same definition more than once form a DAG whose expansion doubles per
level: 5.6 KB with a 40-level chain kept the gateway's grammar check busy for over a minute. So a schema
is refused (400, naming the bound) when its text, its nesting, or its size with every `$ref` expanded
(counted once per use, recursion counted once) is past these.

Any grammar is also refused when its text is past MAX_GRAMMAR_CHARS, or when a part of it needs more
than MAX_NEEDED_CHARS characters before it can end (`a{100000000}`, `(a{1000}){1000}`, an EBNF rule
doubled forty levels deep): once decoding is inside such a part its whole rest is forced, and
jump-forward asks the library for it in one call on the scheduler's step loop (xgrammar allocated
18 GB in a minute for 2^40 forced characters). What a check still cannot bound runs where a timeout
stops it (grammar_sandbox.py)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

try:
    from re import _parser as _sre  # Python 3.11+
except ImportError:  # pragma: no cover
    import sre_parse as _sre  # type: ignore[no-redef]

from shared.grammar_finite import CAP, longest_needed
from shared.grammar_schema import pointer

MAX_GRAMMAR_CHARS = 256 * 1024  # a regex's, an EBNF's or a JSON schema's text
MAX_SCHEMA_CHARS = MAX_GRAMMAR_CHARS
MAX_NEEDED_CHARS = 100_000  # characters a part of a grammar may need before it can end
MAX_SCHEMA_DEPTH = 128  # nested objects / arrays in the schema's JSON
MAX_SCHEMA_NODES = 50_000  # schema nodes with every $ref expanded where it is used

_WHERE = "sampling_params.json_schema"


def check_grammar_cost(kind: str, text: str) -> None:
    """ValueError naming the bound a request's grammar (kind: regex, json_schema, ebnf) is past."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"sampling_params.{kind}: at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
    if kind == "json_schema":
        check_schema_cost(text)
    elif kind == "regex":
        check_needed(kind, _regex_needed(text))
    elif kind == "ebnf":
        check_needed(kind, longest_needed(text))


def check_needed(kind: str, needed: int) -> None:
    """ValueError when a part of the grammar needs more than MAX_NEEDED_CHARS characters to end
    (needed: `longest_needed` of its EBNF, as the xgrammar backend reads every kind)."""
    if needed > MAX_NEEDED_CHARS:
        got = "over 10^12" if needed >= CAP else f"{needed}"
        raise ValueError(
            f"sampling_params.{kind}: a part of it needs {got} characters before it can end; at most "
            f"{MAX_NEEDED_CHARS} (nested repeats, and rules used more than once, multiply it)"
        )


def _regex_needed(pattern: str) -> int:
    """The most characters any part of the regex (a group, an alternative, a repeat) needs, as Python
    reads it; 0 when Python cannot parse it (the library's check then says what is wrong)."""
    try:
        parsed = _sre.parse(pattern)
    except Exception:
        return 0
    most, work = 0, [parsed]
    try:
        while work:
            sub = work.pop()
            most = max(most, sub.getwidth()[0])
            for _op, av in sub.data:
                items = av if isinstance(av, list | tuple) else ()
                for x in items:  # the subpatterns of a group, a repeat, a branch, a lookaround
                    if isinstance(x, _sre.SubPattern):
                        work.append(x)
                    elif isinstance(x, list):
                        work.extend(y for y in x if isinstance(y, _sre.SubPattern))
    except (RecursionError, OverflowError):
        return 0
    return most


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
