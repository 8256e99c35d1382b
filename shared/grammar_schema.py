"""A request's JSON schema as the grammar libraries take it.

`load_schema` (both backends, and the gateway's check): the schema `true` is any JSON value (`{}`),
`false` admits none (a 400), and every `pattern` (and patternProperties key) is rewritten to mean what
Python's `re` means by it (grammar_regex.py), as a client's validator (the `jsonschema` package) reads it.

`xgrammar_schema` (the xgrammar backend): xgrammar 0.2.9 silently ignores some keywords, and its
outputs then break the schema. Those it cannot honour are refused with a 400 naming the keyword and
where it is; a few are rewritten to an equivalent schema it does honour:

    allOf: [A, B]                  -> A and B merged into one schema (properties, required, bounds)
    {"$ref": R, "maxLength": 3}    -> R's schema with the siblings merged in (when R is not recursive here)
    {"anyOf": [A, B], "minLength"} -> {"anyOf": [A + minLength, B + minLength]} (oneOf alike)
    {"enum": [...], "type": ...}   -> the enum values that meet their siblings

A merge that is not plainly equivalent (two different `items`, `additionalProperties` that would
reach the other side's properties, ...) refuses the schema instead.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from shared.grammar_regex import python_regex

_WHERE = "sampling_params.json_schema"
# keywords that do not constrain a value (and $defs, which only holds schemas for $ref)
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "$schema", "$id", "$anchor",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions"}  # fmt: skip
# validation keywords xgrammar 0.2.9 ignores wherever they are
_IGNORED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
            "dependentSchemas", "dependencies")  # fmt: skip
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_MULTIPLES = 1000  # xgrammar honours an integer multipleOf between two bounds up to ~1000 values


def load_schema(text: str) -> Any:
    """The schema of sampling_params.json_schema, ready for either library; ValueError naming the field."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{_WHERE} is not JSON: {e}") from None
    if schema is True:
        return {}
    if schema is False:
        raise ValueError(f"{_WHERE} is invalid: the schema false admits no value")
    if not isinstance(schema, dict):
        raise ValueError(f"{_WHERE} is invalid: a schema is an object, true or false")
    return _python_patterns(schema)


def _python_patterns(node: Any, key: str = "") -> Any:
    if isinstance(node, list):
        return [_python_patterns(x) for x in node]
    if not isinstance(node, dict) or key in ("enum", "const", "default", "examples"):
        return node
    out = {}
    for k, v in node.items():
        if k == "pattern" and isinstance(v, str):
            out[k] = python_regex(v).text
        elif k == "patternProperties" and isinstance(v, dict):
            out[k] = {python_regex(p).text: _python_patterns(s) for p, s in v.items()}
        else:
            out[k] = _python_patterns(v, k)
    return out


def xgrammar_schema(schema: Any) -> Any:
    """`schema` (as load_schema gives it) rewritten for xgrammar; ValueError for what it cannot honour."""
    try:
        return _Rewrite(schema).node(schema, "", ())
    except RecursionError:
        raise ValueError(f"{_WHERE} cannot be used: it is nested too deeply to check") from None
    except (TypeError, AttributeError, KeyError, IndexError) as e:  # a keyword's value of the wrong type
        raise ValueError(f"{_WHERE} is invalid: a keyword's value has the wrong type ({e})") from None


class _Refused(ValueError):
    pass


class _Rewrite:
    """Walks the schema; `chain` holds the $refs inlined on the way here (one met again is recursion,
    which is refused rather than inlined without end)."""

    def __init__(self, root: Any) -> None:
        self.root = root

    def node(self, s: Any, where: str, chain: tuple[str, ...]) -> Any:
        if not isinstance(s, dict):
            return s
        at = where or "/"
        s, chain = self._fold_ref(s, at, chain)
        if "allOf" in s:
            s, chain = self._merge_all_of(s, at, chain)
        for key in ("anyOf", "oneOf"):
            if key in s and _checked(s, key):
                s, chain = self._distribute(s, key, at, chain)
        if ("enum" in s or "const" in s) and _checked(s, "enum", "const"):
            s = _filter_enum(s, at)
        _refuse_ignored(s, at)
        return {k: self._child(k, v, where, chain) for k, v in s.items()}

    def _child(self, key: str, v: Any, where: str, chain: tuple[str, ...]) -> Any:
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            return {n: self.node(x, f"{where}/{key}/{_escape(n)}", chain) for n, x in v.items()}
        if key in ("anyOf", "oneOf", "prefixItems", "items") and isinstance(v, list):
            return [self.node(x, f"{where}/{key}/{i}", chain) for i, x in enumerate(v)]
        if key in ("items", "additionalProperties", "propertyNames", "additionalItems", "unevaluatedItems",
                   "unevaluatedProperties"):  # fmt: skip
            return self.node(v, f"{where}/{key}", chain)
        return v

    def _inline(self, s: dict, at: str, chain: tuple[str, ...], what: str) -> tuple[dict, tuple[str, ...]]:
        """{"$ref": R, ...rest}: R's schema (without its $defs) with rest merged in, R's own $ref folded
        too; _Refused when R is not a local schema, is already being inlined, or does not merge."""
        ref = s["$ref"]
        target = pointer(self.root, ref) if isinstance(ref, str) else None
        if target is True:
            target = {}
        if not isinstance(target, dict) or ref in chain:
            raise _Refused(f"{_WHERE} cannot be used: {what} at {at} is not supported")
        base = {k: v for k, v in target.items() if k not in ("$defs", "definitions")}
        merged = _merge(base, {k: v for k, v in s.items() if k != "$ref"})
        if merged is None:
            raise _Refused(f"{_WHERE} cannot be used: {what} at {at} is not supported")
        chain = (*chain, ref)
        return self._inline(merged, at, chain, what) if "$ref" in merged else (merged, chain)

    def _fold_ref(self, s: dict, at: str, chain: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
        """A $ref with keywords beside it (xgrammar reads only the $ref): both merged into one schema."""
        siblings = _checked(s, "$ref")
        if "$ref" not in s or not siblings:
            return s, chain
        merged, chain = self._inline(s, at, chain, f"{siblings[0]} beside $ref")
        return {**{k: v for k, v in s.items() if k in _ANNOTATIONS}, **merged}, chain

    def _member(self, m: Any, at: str, chain: tuple[str, ...], what: str) -> tuple[dict, tuple[str, ...]]:
        """A schema of allOf / anyOf / oneOf as a dict to merge (its $ref inlined)."""
        if m is True:
            return {}, chain
        if not isinstance(m, dict):
            raise _Refused(f"{_WHERE} cannot be used: {what} at {at} is not supported")
        return self._inline(m, at, chain, what) if "$ref" in m else (m, chain)

    def _merge_all_of(self, s: dict, at: str, chain: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
        members = s["allOf"]
        if not isinstance(members, list):
            raise _Refused(f"{_WHERE} cannot be used: allOf at {at} is not supported")
        out: dict | None = {k: v for k, v in s.items() if k != "allOf"}
        for m in members:
            member, chain = self._member(m, at, chain, "allOf")
            out = _merge(out, member)  # type: ignore[arg-type]
            if out is None:
                raise _Refused(f"{_WHERE} cannot be used: allOf at {at} is not supported (its schemas do not "
                               "merge into one)")  # fmt: skip
        return self._fold_ref(out, at, chain)  # type: ignore[arg-type]

    def _distribute(self, s: dict, key: str, at: str, chain: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
        """{key: [A, B], ...siblings} as {key: [A + siblings, B + siblings]}."""
        siblings = _checked(s, key)
        what = f"{siblings[0]} beside {key}"
        if not isinstance(s[key], list) or ("anyOf" in s and "oneOf" in s):
            raise _Refused(f"{_WHERE} cannot be used: {what} at {at} is not supported")
        rest = {k: s[k] for k in siblings}
        branches = []
        for b in s[key]:
            member, _ = self._member(b, at, chain, what)
            if "type" in member and "type" in rest and not _common_types(member["type"], rest["type"]):
                continue  # a branch of another type than the siblings': no value takes it
            merged = _merge(member, rest)
            if merged is None:
                raise _Refused(f"{_WHERE} cannot be used: {what} at {at} is not supported")
            branches.append(merged)
        if not branches:
            raise _Refused(f"{_WHERE} is invalid: no schema of {key} at {at} has the type beside it")
        return {**{k: v for k, v in s.items() if k not in siblings}, key: branches}, chain


def _checked(s: dict, *besides: str) -> list[str]:
    """The keys of s that constrain a value, other than `besides`."""
    return [k for k in s if k not in _ANNOTATIONS and k not in besides]


def _refuse_ignored(s: dict, at: str) -> None:
    def refuse(key: str, why: str = "") -> None:
        raise _Refused(f"{_WHERE} cannot be used: {key} at {at} is not supported{why}")

    for key in _IGNORED:
        if key in s:
            refuse(key)
    if s.get("uniqueItems") is True:
        refuse("uniqueItems")
    for length in ("minLength", "maxLength"):
        for beside in ("pattern", "format"):
            if length in s and beside in s:
                refuse(f"{length} beside {beside}")
    if "pattern" in s and "format" in s:
        refuse("pattern beside format")
    if "multipleOf" in s and not _honoured_multiple(s):
        refuse("multipleOf", " (only an integer multipleOf of an integer, with no bound or both bounds)")


def _honoured_multiple(s: dict) -> bool:
    m = s["multipleOf"]
    if s.get("type") != "integer" or type(m) is not int or m <= 0:
        return False
    lo = _bound(s, "minimum", "exclusiveMinimum", math.ceil, 1)
    hi = _bound(s, "maximum", "exclusiveMaximum", math.floor, -1)
    if lo is None and hi is None:
        return True
    if lo is None or hi is None:
        return False
    return hi // m - -(-lo // m) + 1 <= _MULTIPLES


def _bound(s: dict, inclusive: str, exclusive: str, to_int, step: int) -> int | None:
    values = []
    if isinstance(s.get(inclusive), (int, float)) and not isinstance(s.get(inclusive), bool):
        values.append(to_int(s[inclusive]))
    x = s.get(exclusive)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        values.append(to_int(x) + step if x == int(x) else to_int(x))
    if not values:
        return None
    return max(values) if step > 0 else min(values)


def _merge(a: dict, b: dict) -> dict | None:
    """One schema that means a and b both (allOf), or None when that is not plain to write."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    for x, y in ((a, b), (b, a)):  # x's additionalProperties would apply to y's other properties
        extra = x.get("additionalProperties", True)
        if extra is not True and set(y.get("properties") or {}) - set(x.get("properties") or {}):
            return None
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
            continue
        u = out[k]
        if u == v or k in _ANNOTATIONS:
            continue
        if k == "required" and isinstance(u, list) and isinstance(v, list):
            out[k] = u + [x for x in v if x not in u]
        elif k == "type":
            common = _common_types(u, v)
            if not common:
                return None
            out[k] = common[0] if len(common) == 1 else common
        elif k == "properties" and isinstance(u, dict) and isinstance(v, dict):
            props = dict(u)
            for name, schema in v.items():
                props[name] = _merge_schema(u[name], schema) if name in u else schema
                if props[name] is None:
                    return None
            out[k] = props
        elif k in ("items", "additionalProperties", "propertyNames"):
            out[k] = _merge_schema(u, v)
            if out[k] is None:
                return None
        elif k in _LOWER + _UPPER and _number(u) and _number(v):
            out[k] = max(u, v) if k in _LOWER else min(u, v)
        elif k == "enum" and isinstance(u, list) and isinstance(v, list):
            out[k] = [x for x in u if x in v]
        else:
            return None
    return out


def _merge_schema(a: Any, b: Any) -> Any:
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    return _merge(a, b)


def _common_types(a: Any, b: Any) -> list:
    """The JSON types both allow ("integer" is a "number")."""
    common = [t for t in _types(a) if t in _types(b) or (t == "integer" and "number" in _types(b))]
    return common + [t for t in _types(b) if t == "integer" and "number" in _types(a) and t not in common]


def _types(t: Any) -> list:
    return t if isinstance(t, list) else [t]


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: Any) -> bool:
    return _number(x) and (isinstance(x, int) or x.is_integer())


def _filter_enum(s: dict, at: str) -> dict:
    """{"enum": values, ...siblings} as the values that meet the siblings (xgrammar ignores them)."""
    values = s["enum"] if "enum" in s else [s["const"]]
    if not isinstance(values, list):
        return s
    siblings = _checked(s, "enum", "const")
    name = "enum" if "enum" in s else "const"
    for key in siblings:
        if key not in _VALUE_CHECKS:
            raise _Refused(f"{_WHERE} cannot be used: {key} beside {name} at {at} is not supported")
    kept = [x for x in values if all(_VALUE_CHECKS[k](x, s[k]) for k in siblings)]
    if not kept:
        raise _Refused(f"{_WHERE} is invalid: no value of the {name} at {at} meets the schema beside it")
    return {**{k: v for k, v in s.items() if k in _ANNOTATIONS}, "enum": kept}


def _is_type(x: Any, t: Any) -> bool:
    def one(name: str) -> bool:
        return {
            "string": isinstance(x, str),
            "integer": _integer(x),
            "number": _number(x),
            "boolean": isinstance(x, bool),
            "null": x is None,
            "array": isinstance(x, list),
            "object": isinstance(x, dict),
        }.get(name, False)

    return any(one(name) for name in _types(t))


def _search(x: Any, pattern: Any) -> bool:
    try:
        return not isinstance(x, str) or re.search(pattern, x, re.ASCII) is not None
    except (re.error, TypeError):
        return True


def _multiple(x: Any, n: Any) -> bool:
    if not _number(x) or not _number(n) or n <= 0:
        return True
    try:
        return float(x / n).is_integer()
    except (OverflowError, ZeroDivisionError):
        return True


_VALUE_CHECKS = {
    "type": _is_type,
    "minLength": lambda x, n: not isinstance(x, str) or len(x) >= n,
    "maxLength": lambda x, n: not isinstance(x, str) or len(x) <= n,
    "pattern": _search,
    "minimum": lambda x, n: not _number(x) or x >= n,
    "maximum": lambda x, n: not _number(x) or x <= n,
    "exclusiveMinimum": lambda x, n: not _number(x) or not _number(n) or x > n,
    "exclusiveMaximum": lambda x, n: not _number(x) or not _number(n) or x < n,
    "multipleOf": _multiple,
}


def pointer(root: Any, ref: str) -> Any:
    """The subschema a local $ref ("#", "#/$defs/x") points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
