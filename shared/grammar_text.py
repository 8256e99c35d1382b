"""A request's grammar (`regex`, `json_schema` or `ebnf` in sampling_params) as llguidance grammar
text, and a check of it that needs no tokenizer (~1 ms for ordinary grammars). The gateway checks
every grammar before it publishes the request, so an unparsable regex or EBNF, a schema that
llguidance cannot use, or a grammar that accepts no finite string (`root ::= "a" root`, a schema
that requires itself: decoding one never ends) is a 400 that never reaches a scheduler; the scheduler
compiles the same text against its tokenizer (services/scheduler/constrained/).

`check_grammar` runs the check in a worker process (grammar_sandbox.py) with a timeout that kills it:
a grammar whose check would run for minutes is a 400 after `--grammar-check-timeout` seconds, and the
thread that asked (the gateway's tokenizer pool, shared with chat rendering) is free again.

A regex means what Python's `re` means by it, with ASCII classes (grammar_regex.py); a JSON schema
`true` is any JSON value, `false` a 400 (grammar_schema.py)."""

from __future__ import annotations

import atexit
import logging
import re
import threading

from shared.grammar_sandbox import GrammarSandbox, GrammarTimeout, WorkerDied

log = logging.getLogger(__name__)
KINDS = ("regex", "json_schema", "ebnf")
CHECK_TIMEOUT_S = 5.0  # default of the gateway's --grammar-check-timeout (~1 ms for ordinary grammars)
CHECK_WORKERS = 2  # processes; as many as the gateway's tokenizer threads that may ask at once
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


_checks: GrammarSandbox | None = None
_checks_lock = threading.Lock()
_timeout_s = CHECK_TIMEOUT_S


def set_check_timeout(seconds: float) -> None:
    """How long `check_grammar` lets a check run (the gateway's --grammar-check-timeout)."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError("grammar_check_timeout must be > 0")
    _timeout_s = seconds


def check_grammar(kind: str, text: str, backend: str | None = None, timeout_s: float | None = None) -> str:
    """`check_grammar_here` in a worker process, stopped after timeout_s (unset: the configured one):
    ValueError naming the field when the grammar is invalid, took too long, or killed its worker."""
    from shared.grammar_limits import MAX_GRAMMAR_CHARS

    if len(text) > MAX_GRAMMAR_CHARS:  # before it is copied to a worker
        raise ValueError(f"sampling_params.{kind}: at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
    timeout_s = _timeout_s if timeout_s is None else timeout_s
    try:
        return _sandbox().run(timeout_s, check_grammar_here, kind, text, backend)
    except GrammarTimeout:
        log.warning("a %s of %d characters took longer than %g s to check: its worker was killed", kind,
                    len(text), timeout_s)  # fmt: skip
        raise ValueError(
            f"sampling_params.{kind} took longer than {timeout_s:g} s to check; simplify it"
        ) from None
    except WorkerDied as e:
        raise ValueError(f"sampling_params.{kind} could not be checked: {e}; simplify it") from None


def _sandbox() -> GrammarSandbox:
    global _checks
    with _checks_lock:
        if _checks is None:
            _checks = GrammarSandbox(CHECK_WORKERS, init=_warm)
            atexit.register(_checks.close)
        return _checks


def _warm() -> None:
    """A worker's start: the imports and llguidance's first parse, before any request's timeout runs."""
    check_grammar_here("regex", "[0-9]+")


def check_grammar_here(kind: str, text: str, backend: str | None = None) -> str:
    """The grammar text, after llguidance parsed it and it was found to accept a finite string and to
    be within the bounds of grammar_limits.py; ValueError with the reason otherwise. backend="xgrammar"
    also refuses the JSON-schema keywords that xgrammar would ignore (grammar_schema.py), as its
    compile does. In this process: no timeout can stop it."""
    from llguidance import LLMatcher

    from shared.grammar_finite import never_ends
    from shared.grammar_limits import check_grammar_cost

    check_grammar_cost(kind, text)  # before any library expands it
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
