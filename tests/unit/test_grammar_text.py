"""The gateway's grammar check (shared/grammar_text.py) and the checks it shares with the schedulers'
compile, with no tokenizer and no model: grammars that accept no finite string are refused
(grammar_finite.py), a regex means what Python's `re` means (grammar_regex.py), a JSON schema is taken as a
client's validator reads it, and the keywords xgrammar would ignore are refused or rewritten
(grammar_schema.py)."""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("llguidance")

from shared.grammar_finite import grammar_never_ends, schema_never_ends  # noqa: E402
from shared.grammar_regex import python_regex  # noqa: E402
from shared.grammar_schema import load_schema, xgrammar_schema  # noqa: E402
from shared.grammar_text import check_grammar  # noqa: E402

RECURSIVE_OBJECT = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"],
                    "additionalProperties": False}  # fmt: skip
RECURSIVE_ARRAY = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
# (kind, text, what the 400 says): decoding any of them never ends (jump-forward loops on the first four)
ENDLESS = [
    ("ebnf", 'root ::= "a" root', "the grammar accepts no finite string (rule root never ends)"),
    ("ebnf", 'root ::= "(" root ")"', "the grammar accepts no finite string (rule root never ends)"),
    ("json_schema", json.dumps(RECURSIVE_OBJECT), "the schema admits no finite JSON value"),
    ("json_schema", json.dumps(RECURSIVE_ARRAY), "the schema admits no finite JSON value"),
    ("ebnf", 'root ::= "a" | "b" x\nx ::= "c" x', "rule x never ends"),  # an alternative that never ends
    (
        "ebnf",
        'root ::= "a" x{1,3}\nx ::= "b" x',
        "the grammar accepts no finite string (rule root never ends)",
    ),
    ("regex", r"[^\s\S]", "the regex accepts no string"),
    ("regex", r"a([^\d\D]|c[^\w\W])", "the regex accepts no string"),
]
# recursion with a way out, and empty parts that can be left out
FINITE = [
    ("ebnf", 'root ::= "a" root | "b"'),
    ("ebnf", 'root ::= "(" root ")" | "x"\n# a comment with "quotes" and ::='),
    ("ebnf", 'root ::= item ("," item)*\nitem ::= [a-z]+ | "[" root "]"'),
    ("json_schema", json.dumps({**RECURSIVE_OBJECT, "required": []})),
    ("json_schema", json.dumps({**RECURSIVE_ARRAY, "minItems": 0})),
    (
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                "required": ["a"],
            }
        ),
    ),  # fmt: skip
    ("regex", r"a|[^\s\S]"),
    ("regex", r"a([^\s\S]b)?"),
]


@pytest.mark.parametrize(("kind", "text", "why"), ENDLESS)
def test_a_grammar_that_accepts_no_finite_string_is_refused(kind, text, why):
    with pytest.raises(ValueError, match=re.escape(f"sampling_params.{kind} is invalid: {why}")):
        check_grammar(kind, text)


@pytest.mark.parametrize(("kind", "text"), FINITE)
def test_recursion_with_a_way_out_passes(kind, text):
    assert check_grammar(kind, text)


def test_xgrammars_normalized_grammars_are_read_alike():
    """The schedulers' xgrammar check reads xgrammar's own normalized EBNF (str() of a Grammar): the
    same verdicts, and xgrammar's reading of a schema with no type counts (an object there)."""
    xgr = pytest.importorskip("xgrammar")
    for kind, text, _ in ENDLESS[:5]:
        grammar = xgr.Grammar.from_ebnf(text) if kind == "ebnf" else xgr.Grammar.from_json_schema(text)
        assert grammar_never_ends(kind, str(grammar)), text
    for kind, text in FINITE[:6]:
        grammar = xgr.Grammar.from_ebnf(text) if kind == "ebnf" else xgr.Grammar.from_json_schema(text)
        assert grammar_never_ends(kind, str(grammar)) is None, text
    untyped = json.dumps({"properties": {"a": {"$ref": "#"}}, "required": ["a"]})  # any non-object would do
    assert schema_never_ends(json.loads(untyped)) is None
    assert grammar_never_ends("json_schema", str(xgr.Grammar.from_json_schema(untyped)))
    empty = str(xgr.Grammar.from_regex(python_regex(r"[^\s\S]").text))
    assert (
        grammar_never_ends("regex", empty) == "sampling_params.regex is invalid: the regex accepts no string"
    )


def test_the_finite_check_never_raises_on_odd_text():
    rng = random.Random(0)
    pieces = ['root', '::=', 'x', '"a"', '"', '[', ']', '[^\\', '(', ')', '(=', '|', '*', '{1,', '}',
              '{0, -1}', 'Regex(', '#', '\n', ' ', '\\', 'TagDispatch(("<", x))', '[^\\0-\\U0010ffff]',
              '::']  # fmt: skip
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert grammar_never_ends("ebnf", text) is None or "never ends" in grammar_never_ends("ebnf", text)
    for text in ("root ::= ()", 'root ::= "a" |', "root ::= (|)*", "root ::="):
        assert grammar_never_ends("ebnf", text) is None
    deep = "root ::= " + "(" * 5000 + '"a"' + ")" * 5000
    assert grammar_never_ends("ebnf", deep) is None
    for schema in ([1], 3, None, {"type": "array", "minItems": "x"}, {"$ref": "#/nowhere"}, {"required": 5},
                   {"type": "object", "required": ["a"], "properties": []}):  # fmt: skip
        assert schema_never_ends(schema) is None


@pytest.mark.parametrize(
    ("pattern", "rewritten"),
    [
        (r"x.{5}y", r"x[^\n]{5}y"),  # xgrammar's "." took a newline
        (r"a\x00b", r"a\u0000b"),  # xgrammar read \x00b as the one character U+000B
        (r"\s\S", r"[\t-\r ][^\t-\r ]"),  # xgrammar's \s took Unicode blanks
        (r"\d+\w?", r"[0-9]+[0-9A-Z_a-z]?"),
        (r"[^\s\S]", r"[^\u0000-\U0010ffff]"),
        (r"(?P<n>\d{2})-[äö]", r"(?:[0-9]{2})-[\u00e4\u00f6]"),
        (r"[\^a]{3}", r"[a\^]{3}"),  # xgrammar reads a class's first "^" as negation, even escaped
        (r"(?i)hello", r"(?i)hello"),  # what the rewrite does not model: as it was
        (r"a(?=b)", r"a(?=b)"),
        (r"(unclosed", r"(unclosed"),
    ],
)
def test_a_regex_is_rewritten_to_mean_what_python_re_means(pattern, rewritten):
    assert python_regex(pattern).text == rewritten


def test_rewritten_regexes_match_what_python_matches():
    patterns = [r"x.{2}y", r"\s\S\w\W", r"[^\d\s]+", r"(?s)a.b", r"a\x00b", r"[\^a-c]+", r"(ab|c)*d?",
                r"[^a]\D", r"\u00e9|\U0001F600", r"a{,2}b", r"[\]\-\\]+"]  # fmt: skip
    texts = ["", "a", "b", "ab", "x\ny", "x  y", "xaby", " a_!", "\u2003a_!", "\t\x00b_", "é", "\U0001f600",
             "a\nb", "a\x00b", "a\x0bb", "^^", "abcd", "ccd", "b9", "\u0663", "aab", "]-\\",
             "z1"]  # fmt: skip
    for p in patterns:
        new = python_regex(p).text
        for t in texts:
            assert bool(re.fullmatch(new, t)) == bool(re.fullmatch(p, t, re.ASCII)), (p, new, t)


def test_json_schema_true_is_any_value_and_false_a_400():
    assert load_schema("true") == {} and check_grammar("json_schema", "true")
    with pytest.raises(
        ValueError, match="sampling_params.json_schema is invalid: the schema false admits no value"
    ):
        check_grammar("json_schema", "false")


def test_a_multi_line_alternation_passes_the_early_check():
    grammar = 'root ::=\n    "a"\n    | "b"  # the second\n    | "c"\nother ::= "#" [#]'
    assert '"b"' in check_grammar("ebnf", grammar)


def test_json_schema_patterns_mean_what_python_re_means():
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": r"^a.\sb$"}},
              "patternProperties": {r"^x\d$": {"type": "integer"}}}  # fmt: skip
    out = load_schema(json.dumps(schema))
    assert out["properties"]["s"]["pattern"] == r"^a[^\n][\t-\r ]b$"
    assert list(out["patternProperties"]) == [r"^x[0-9]$"]


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf at / is not supported"),
        (
            {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$", "maxLength": 3}}},
            "maxLength beside pattern at /properties/s is not supported",
        ),  # fmt: skip
        ({"type": "number", "multipleOf": 0.5}, "multipleOf at / is not supported"),
        ({"type": "integer", "multipleOf": 5, "minimum": 3}, "multipleOf at / is not supported"),
        (
            {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            "uniqueItems at / is not supported",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#", "minProperties": 1}}},
            "minProperties beside $ref at /properties/a",
        ),  # fmt: skip
        (
            {"type": "object", "properties": {"k": {"type": "integer", "not": {"const": 3}}}},
            "not at /properties/k is not supported",
        ),  # fmt: skip
    ],
)
def test_schema_keywords_xgrammar_would_ignore_are_refused_with_where(schema, message):
    with pytest.raises(ValueError, match=re.escape(f"sampling_params.json_schema cannot be used: {message}")):
        xgrammar_schema(load_schema(json.dumps(schema)))


def test_the_gateway_refuses_them_for_xgrammar_only():
    text = json.dumps(
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$", "maxLength": 3}}}
    )
    check_grammar("json_schema", text)  # llguidance takes it
    with pytest.raises(ValueError, match="maxLength beside pattern at /properties/s"):
        check_grammar("json_schema", text, backend="xgrammar")


def test_schema_keywords_xgrammar_would_ignore_are_rewritten_when_that_is_plain():
    defs = {"s": {"type": "string"}, "n": {"type": "integer"}}
    schema = {"$defs": defs, "type": "object", "required": ["a", "b", "c", "d"], "properties": {
        "a": {"$ref": "#/$defs/s", "maxLength": 3},  # siblings of $ref
        "b": {"$ref": "#/$defs/n", "minimum": 3},
        "c": {"anyOf": [{"type": "string"}, {"type": "null"}], "minLength": 2},  # siblings of anyOf
        "d": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                        {"$ref": "#/$defs/y"}]}}}  # fmt: skip
    defs["y"] = {"type": "object", "properties": {"y": {"type": "string", "maxLength": 4}}, "required": ["y"]}
    props = xgrammar_schema(load_schema(json.dumps(schema)))["properties"]
    assert props["a"] == {"type": "string", "maxLength": 3}
    assert props["b"] == {"type": "integer", "minimum": 3}
    assert props["c"] == {"anyOf": [{"type": "string", "minLength": 2}, {"type": "null", "minLength": 2}]}
    merged = {"x": {"type": "integer"}, **defs["y"]["properties"]}
    assert props["d"] == {"type": "object", "properties": merged, "required": ["x", "y"]}
    enum = {"type": "string", "enum": ["a", "bb", 3], "minLength": 2}  # the values its siblings take
    assert xgrammar_schema(load_schema(json.dumps(enum))) == {"enum": ["bb"]}
