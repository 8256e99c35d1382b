"""A request's grammar (`regex`, `json_schema` or `ebnf` in sampling_params) as llguidance grammar
text, and a syntax check of it that needs no tokenizer (~1 ms for ordinary grammars). The gateway
checks every grammar before it publishes the request, so an unparsable regex or EBNF, or a schema
that llguidance cannot use, is a 400 that never reaches a scheduler; the scheduler compiles the same
text against its tokenizer (services/scheduler/constrained/)."""

from __future__ import annotations

import json
import re

KINDS = ("regex", "json_schema", "ebnf")
# fixed separators, no free whitespace in JSON: a model cannot loop on blank space
_JSON_OVERRIDES = {"whitespace_flexible": False}


def grammar_of(sampling) -> tuple[str, str] | None:
    """(kind, text) of the grammar a SamplingParams asks for, or None."""
    return next(((k, getattr(sampling, k)) for k in KINDS if getattr(sampling, k) is not None), None)


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for it; ValueError naming the field when it cannot be converted."""
    from llguidance import LLMatcher

    if kind == "regex":  # \d \w \s as ASCII classes, as xgrammar (SGLang), JavaScript and JSON Schema
        from llguidance import regex_to_lark  # read them: [0-9], [0-9a-zA-Z_], [ \t\n\r\f\v]

        return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(text, 'dws')}/")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"sampling_params.json_schema is not JSON: {e}") from None
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OVERRIDES)
        except ValueError as e:
            raise ValueError(f"sampling_params.json_schema cannot be used: {e}") from None
    if kind == "ebnf":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return LLMatcher.grammar_from_lark(any_to_lark(text))
        except Exception as e:  # the converter's own parse errors
            raise ValueError(f"sampling_params.ebnf does not parse: {e}") from None
    raise ValueError(f"unknown grammar kind {kind!r}; allowed: {', '.join(KINDS)}")


def check_grammar(kind: str, text: str) -> str:
    """The grammar text, after llguidance parsed it; ValueError with its message otherwise."""
    from llguidance import LLMatcher

    grammar = grammar_text(kind, text)
    error = LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"sampling_params.{kind} is invalid: {one_line(error)}")
    return grammar


def one_line(error: str) -> str:
    """llguidance's message without its source excerpts and carets, on one line (for a 400)."""
    lines = (line.strip() for line in error.splitlines())
    return " ".join(x for x in lines if x and not re.fullmatch(r"\^+|\d+ \|.*", x))
