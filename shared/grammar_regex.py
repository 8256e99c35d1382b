r"""A request's regex as Python's `re` reads it (with ASCII classes), rewritten for the grammar libraries.

Clients check a constrained output with Python's `re.fullmatch`; xgrammar reads some regexes another
way: `.` takes a newline, `\x00b` is the one character U+000B (it reads every hex digit that
follows), `\s` takes Unicode blanks. So the pattern is parsed with Python's own parser and written
again in a form that xgrammar, llguidance (Rust's regex syntax) and Python all read alike:

    .                -> [^\n]  (any character with (?s))
    \d \w \s, \D ... -> [0-9] [0-9A-Z_a-z] [\t-\r ], their complements: ASCII, as in JSON Schema
    [...] classes    -> the set they mean, as sorted ranges (so [^\s\S] is the empty class)
    a character      -> itself when printable ASCII, else \uHHHH / \UHHHHHHHH
    (?P<name>...)    -> (?:...) (no backreferences: a group's name changes nothing)

A pattern Python refuses, or one using what this rewrite does not model (lookaround, backreferences,
\b, case-insensitive or multi-line flags, atomic groups), is returned as it is: the library then
takes or refuses it, as before.
"""

from __future__ import annotations

import re
from typing import NamedTuple

try:
    from re import _parser as _sre  # Python 3.11+
except ImportError:  # pragma: no cover
    import sre_parse as _sre  # type: ignore[no-redef]

_MAX = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # never in UTF-8 text, and not characters to Rust's regex
_DIGIT = [(0x30, 0x39)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_CATEGORIES = {"DIGIT": _DIGIT, "SPACE": _SPACE, "WORD": _WORD}
_META = set(r"\.^$|?*+()[]{}")
_CLASS_META = set("\\]-[^")
_NAMED = {0x09: r"\t", 0x0A: r"\n", 0x0B: r"\v", 0x0C: r"\f", 0x0D: r"\r"}


class PyRegex(NamedTuple):
    text: str  # the pattern to give the library
    empty: bool  # it matches no string at all (a class like [^\s\S] that nothing is in)


class _Unsupported(Exception):
    pass


def python_regex(pattern: str) -> PyRegex:
    """The pattern rewritten to mean what Python's re.fullmatch (ASCII classes) means by it."""
    try:
        parsed = _sre.parse(pattern)
    except Exception:  # not a Python regex (or too deep): the library's own parser decides
        return PyRegex(pattern, False)
    flags = parsed.state.flags
    if flags & (re.IGNORECASE | re.MULTILINE):
        return PyRegex(pattern, False)
    try:
        text, empty, _ = _Writer(bool(flags & re.DOTALL)).seq(list(parsed))
    except (_Unsupported, RecursionError):
        return PyRegex(pattern, False)
    return PyRegex(text, empty)


class _Writer:
    """Each item becomes (text, matches nothing, atomic: a quantifier may follow the text as it is)."""

    def __init__(self, dotall: bool) -> None:
        self.dotall = dotall

    def seq(self, items: list) -> tuple[str, bool, bool]:
        parts = [self.item(op, av) for op, av in items]
        atomic = len(parts) == 1 and parts[0][2]
        return "".join(t for t, _, _ in parts), any(e for _, e, _ in parts), atomic

    def item(self, op, av) -> tuple[str, bool, bool]:
        name = getattr(op, "name", str(op))
        if name == "LITERAL":
            return self.chars([(av, av)], False)
        if name == "NOT_LITERAL":
            return self.chars([(av, av)], True)
        if name == "ANY":
            return self.chars([] if self.dotall else [(0x0A, 0x0A)], True)
        if name == "IN":
            return self.chars(*_class_set(av))
        if name == "BRANCH":
            alts = [self.seq(list(a)) for a in av[1]]
            return "(?:" + "|".join(t for t, _, _ in alts) + ")", all(e for _, e, _ in alts), True
        if name == "SUBPATTERN":
            _group, add, remove, inner = av
            if add or remove:  # scoped flags, (?i:...)
                raise _Unsupported
            text, empty, atomic = self.seq(list(inner))
            return (text if atomic else f"(?:{text})"), empty, True
        if name in ("MAX_REPEAT", "MIN_REPEAT"):  # lazy or greedy: the same strings
            lo, hi, inner = av
            text, empty, atomic = self.seq(list(inner))
            return (text if atomic else f"(?:{text})") + _quantifier(lo, hi), empty and lo > 0, False
        if name == "AT":
            at = getattr(av, "name", str(av))
            if at in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
                return "^", False, False
            if at in ("AT_END", "AT_END_STRING"):
                return "$", False, False
        raise _Unsupported  # lookaround, backreferences, \b, atomic and possessive forms, ...

    def chars(self, ranges: list[tuple[int, int]], negate: bool) -> tuple[str, bool, bool]:
        """A set of characters as one atom: a single character, or a class."""
        have = _normalize(ranges)
        if negate:
            have = _complement(have)
        if len(have) == 1 and have[0][0] == have[0][1]:
            return _char(have[0][0], _META), False, True
        if not have:
            return r"[^\u0000-\U0010ffff]", True, True
        lacking = _complement(have)
        if not lacking:  # every character
            return r"[\u0000-\U0010ffff]", False, True
        if len(lacking) < len(have):
            return "[^" + _ranges(lacking) + "]", False, True
        if have[0][0] == ord("^"):  # xgrammar reads a class's first "^" as negation, even escaped
            rest = [(0x5F, have[0][1])] if have[0][1] > 0x5E else []
            return "[" + _ranges(rest + have[1:]) + "\\^]", False, True
        return "[" + _ranges(have) + "]", False, True


def _class_set(items) -> tuple[list[tuple[int, int]], bool]:
    ranges: list[tuple[int, int]] = []
    negate = False
    for op, av in items:
        name = getattr(op, "name", str(op))
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            ranges.append((av, av))
        elif name == "RANGE":
            ranges.append(av)
        elif name == "CATEGORY":
            cat = getattr(av, "name", str(av)).removeprefix("CATEGORY_")
            base = _CATEGORIES.get(cat.removeprefix("NOT_"))
            if base is None:  # a locale or line-break category
                raise _Unsupported
            ranges.extend(_complement(base) if cat.startswith("NOT_") else base)
        else:
            raise _Unsupported
    return ranges, negate


def _normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged, without surrogates."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        for a, b in _cut_surrogates(lo, hi):
            if out and a <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return out


def _cut_surrogates(lo: int, hi: int) -> list[tuple[int, int]]:
    s0, s1 = _SURROGATES
    if hi < s0 or lo > s1:
        return [(lo, hi)]
    return [(a, b) for a, b in ((lo, s0 - 1), (s1 + 1, hi)) if a <= b]


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in _normalize(ranges):
        if lo > at:
            out.extend(_cut_surrogates(at, lo - 1))
        at = max(at, hi + 1)
    if at <= _MAX:
        out.extend(_cut_surrogates(at, _MAX))
    return out


def _quantifier(lo: int, hi: int) -> str:
    unbounded = hi == _sre.MAXREPEAT
    if (lo, unbounded) == (0, True):
        return "*"
    if (lo, unbounded) == (1, True):
        return "+"
    if (lo, hi) == (0, 1):
        return "?"
    if unbounded:
        return f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _ranges(ranges: list[tuple[int, int]]) -> str:
    out = []
    for lo, hi in ranges:
        if lo == hi:
            out.append(_char(lo, _CLASS_META))
        elif hi == lo + 1:
            out.append(_char(lo, _CLASS_META) + _char(hi, _CLASS_META))
        else:
            out.append(_char(lo, _CLASS_META) + "-" + _char(hi, _CLASS_META))
    return "".join(out)


def _char(c: int, meta: set[str]) -> str:
    if 0x20 <= c < 0x7F:
        ch = chr(c)
        return "\\" + ch if ch in meta else ch
    if c in _NAMED:
        return _NAMED[c]
    return f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"
