"""A request's grammar (`regex`, `json_schema` or `ebnf` in sampling_params) as llguidance grammar
text, and a check of it that needs no tokenizer (~1 ms for ordinary grammars). The gateway checks
every grammar before it publishes the request, so an unparsable regex or EBNF, a schema that
llguidance cannot use, or a grammar that accepts no finite string (`root ::= "a" root`, a schema
that requires itself: decoding one never ends) is a 400 that never reaches a scheduler; the scheduler
compiles the same text against its tokenizer (services/scheduler/constrained/).

A regex means what Python's `re` means by it, with ASCII classes (grammar_regex.py); a JSON schema
`true` is any JSON value, `false` a 400 (grammar_schema.py)."""

from __future__ import annotations

import re

KINDS = ("regex", "json_schema", "ebnf")
# fixed separators, no free whitespace in JSON: a model cannot loop on blank space
_JSON_OVERRIDES = {"whitespace_flexible": False}
_RULE_START = re.compile(r"\s*[A-Za-z_][\w.\-]*\s*::=")
# a line's code before its comment: strings and classes may hold "#"
_CODE = re.compile(r"""(?:"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[^#"\[])*""")


def grammar_of(sampling) -> tuple[str, str] | None:
    """(kind, text) of the grammar a SamplingParams asks for, or None."""
    return next(((k, getattr(sampling, k)) for k in KINDS if getattr(sampling, k) is not None), None)


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for it; ValueError naming the field when it cannot be converted."""
    from llguidance import LLMatcher

    if kind == "regex":  # \d \w \s as ASCII classes, as xgrammar (SGLang), JavaScript and JSON Schema
        from llguidance import regex_to_lark  # read them: [0-9], [0-9a-zA-Z_], [ \t\n\r\f\v]

        from shared.grammar_regex import python_regex

        return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(python_regex(text).text, 'dws')}/")
    if kind == "json_schema":
        from shared.grammar_schema import load_schema

        schema = load_schema(text)
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OVERRIDES)
        except ValueError as e:
            raise ValueError(f"sampling_params.json_schema cannot be used: {e}") from None
    if kind == "ebnf":
        from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

        try:
            lark = any_to_lark(text if is_lark_syntax(text) else one_rule_a_line(text))
            return LLMatcher.grammar_from_lark(lark)
        except Exception as e:  # the converter's own parse errors
            raise ValueError(f"sampling_params.ebnf does not parse: {e}") from None
    raise ValueError(f"unknown grammar kind {kind!r}; allowed: {', '.join(KINDS)}")


def check_grammar(kind: str, text: str, backend: str | None = None) -> str:
    """The grammar text, after llguidance parsed it and it was found to accept a finite string;
    ValueError with the reason otherwise. backend="xgrammar" also refuses the JSON-schema keywords
    that xgrammar would ignore (grammar_schema.py), as its compile does."""
    from llguidance import LLMatcher

    from shared.grammar_finite import never_ends

    if kind == "json_schema":
        from shared.grammar_limits import check_schema_cost

        check_schema_cost(text)  # before any library expands it
    grammar = grammar_text(kind, text)
    why = never_ends(kind, text)
    if why:
        raise ValueError(why)
    error = LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"sampling_params.{kind} is invalid: {one_line(error)}")
    if backend == "xgrammar" and kind == "json_schema":
        from shared.grammar_schema import load_schema, xgrammar_schema

        xgrammar_schema(load_schema(text))
    return grammar


def one_rule_a_line(ebnf: str) -> str:
    """The EBNF with each rule on one line, comments dropped. llguidance's GBNF converter (llama.cpp's
    syntax) ends a rule at a line's end outside parentheses; xgrammar (SGLang's EBNF) lets a rule go
    on, as in `root ::=` then lines `"a"`, `| "b"`: lines that do not start a rule join the one before."""
    rules: list[str] = []
    for line in ebnf.splitlines():
        code = _CODE.match(line).group()  # type: ignore[union-attr]
        if line[len(code) :] and not line[len(code) :].startswith("#"):  # an unclosed string: as it is
            code = line
        code = code.rstrip()
        if not code.strip():
            continue
        if rules and not _RULE_START.match(code):
            rules[-1] += " " + code.strip()
        else:
            rules.append(code)
    return "\n".join(rules) + "\n"


def one_line(error: str) -> str:
    """llguidance's message without its source excerpts and carets, on one line (for a 400)."""
    lines = (line.strip() for line in error.splitlines())
    return " ".join(x for x in lines if x and not re.fullmatch(r"\^+|\d+ \|.*", x))
