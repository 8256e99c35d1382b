"""Grammars that accept no finite string, found before any matcher runs.

`root ::= "a" root` and a JSON schema whose object requires itself have no finite string: nothing can
end them. A matcher never refuses a token of one, so decoding runs to max_new_tokens, and worse,
jump-forward asks for the forced continuation, which is endless: xgrammar's
`find_jump_forward_string` then allocates until the process is killed, llguidance gives up with a
parser error. A rule that can derive a finite string is *productive*:

    a literal, a character class with a character in it, x*, x?, x{0,n}     productive
    a reference                      productive when its rule is
    a sequence                       when all its elements are
    alternatives                     when one of them is

the least fixed point over the rules. A grammar is refused when a rule reachable from its root is not
productive (one such rule behind an alternative is enough for jump-forward to loop once the model
takes that alternative). The analysis reads xgrammar's normalized EBNF (str() of a Grammar) or a
request's own EBNF; what it does not know (xgrammar's Regex(...), TagDispatch(...), an unreadable
text) counts as productive, so it never refuses a grammar it does not understand and never raises.
A JSON schema is also checked on its own terms (`schema_never_ends`), which needs no grammar library:
the gateway's check runs it.
"""

from __future__ import annotations

import heapq
import json
import re
from typing import Any

from shared.grammar_schema import pointer

_TOKEN = re.compile(
    r"""(?P<space>\s+|\#[^\n]*)
    |(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<cls>\[(?:[^\]\\]|\\.)*\])
    |(?P<define>::=)
    |(?P<look>\(=)
    |(?P<call>(?:Regex|TagDispatch|TokenTagDispatch|Token|ExcludeToken)\()
    |(?P<name>[A-Za-z_][\w.\-]*)
    |(?P<repeat>\{\s*-?\d*\s*(?:,\s*-?\d*\s*)?\})
    |(?P<op>[()|*+?])
    |(?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
_MAX = 0x10FFFF
_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}
_NEVER = ("empty",)  # a node that derives nothing (an empty character class)
_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
CAP = 10**12  # lengths past this are this


def grammar_never_ends(kind: str, ebnf: str) -> str | None:
    """Why the grammar of a request's `kind`, as EBNF (the request's own, or xgrammar's normalized text
    of any kind), accepts no finite string; None when it does or when the text cannot be read."""
    found = unending_rule(ebnf)
    if found is None:
        return None
    name, is_root = found
    where = f"sampling_params.{kind} is invalid"
    if kind == "regex":  # no recursion in a regex: only an empty one is a problem
        return f"{where}: the regex accepts no string" if is_root else None
    if kind == "json_schema":
        if is_root:
            return f"{where}: the schema admits no finite JSON value"
        return (f"{where}: a part of the schema admits no finite JSON value (it requires itself with no way "
                f"out; grammar rule {name} never ends)")  # fmt: skip
    if is_root:
        return f"{where}: the grammar accepts no finite string (rule {name} never ends)"
    return f"{where}: rule {name} never ends (no finite string completes it)"


def unending_rule(text: str) -> tuple[str, bool] | None:
    """(name, is the root) of the rule nearest the root that derives no finite string, or None."""
    try:
        rules, order = _parse(text)
    except (_Unreadable, RecursionError):
        return None
    root = "root" if "root" in rules else order[0]
    productive = shortest_lengths(rules)[0]
    bad = next((name for name in _reachable(rules, root) if name not in productive), None)
    return None if bad is None else (bad, bad == root)


class _Unreadable(Exception):
    pass


def _parse(text: str) -> tuple[dict[str, Any], list[str]]:
    """Rule name -> body node; a node is the characters a leaf takes (an int), _NEVER, ("ref", name),
    ("seq", [...]), ("alt", [...]) or ("rep", m, node): node at least m >= 2 times."""
    toks = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(text) if m.lastgroup != "space"]
    starts = [i for i in range(len(toks) - 1) if toks[i][0] == "name" and toks[i + 1][0] == "define"]
    if not starts:
        raise _Unreadable
    rules: dict[str, Any] = {}
    order = []
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(toks)
        body, at = _alternatives(toks, i + 2, end)
        if at < end:  # a stray ")": not ours to judge (the library reports the syntax)
            body = 0
        name = toks[i][1]
        if name not in rules:
            order.append(name)
            rules[name] = body
        else:  # a rule given twice (some dialects): either body will do
            rules[name] = ("alt", [rules[name], body])
    return rules, order


def _alternatives(toks: list, i: int, end: int) -> tuple[Any, int]:
    alts = []
    while True:
        seq, i = _sequence(toks, i, end)
        alts.append(seq)
        if i < end and toks[i] == ("op", "|"):
            i += 1
            continue
        return (alts[0] if len(alts) == 1 else ("alt", alts)), i


def _sequence(toks: list, i: int, end: int) -> tuple[Any, int]:
    items: list[Any] = []
    while i < end:
        kind, text = toks[i]
        if kind == "op" and text in "|)":
            break
        if kind == "look":  # a lookahead (=...): zero-width, left out
            i = _skip_group(toks, i + 1, end)
            continue
        if kind == "op" and text == "(":
            node, i = _alternatives(toks, i + 1, end)
            if i < end and toks[i] == ("op", ")"):
                i += 1
        elif kind == "call":  # Regex("..."), TagDispatch(...): opaque
            node, i = 0, _skip_group(toks, i + 1, end)
        elif kind == "name":
            node, i = ("ref", text), i + 1
        elif kind == "cls":
            node, i = (1 if _class_has_chars(text) else _NEVER), i + 1
        elif kind == "string":
            node, i = _string_length(text), i + 1
        else:  # whatever else is there
            node, i = 0, i + 1
        while i < end and (toks[i][0] == "repeat" or toks[i] in (("op", "*"), ("op", "+"), ("op", "?"))):
            least = 0 if toks[i][1] in "*?" else 1 if toks[i][1] == "+" else _repeat_min(toks[i][1])
            if least == 0:
                node = ("alt", [0, node])  # may be left out; its references still count as reachable
            elif least > 1:
                node = ("rep", least, node)
            i += 1
        items.append(node)
    return ("seq", items), i


def _skip_group(toks: list, i: int, end: int) -> int:
    """The index after the ")" that closes a group whose "(" came just before i."""
    depth = 1
    while i < end and depth:
        if toks[i][0] in ("look", "call") or toks[i] == ("op", "("):
            depth += 1
        elif toks[i] == ("op", ")"):
            depth -= 1
        i += 1
    return i


def _string_length(text: str) -> int:
    """The characters of a quoted literal, an escape counting one."""
    return len(_ESCAPE.sub("_", text[1:-1]))


def _repeat_min(text: str) -> int:
    lo = text.strip("{} ").split(",")[0].strip()
    return int(lo) if lo.lstrip("-").isdigit() else 0


def _class_has_chars(text: str) -> bool:
    """Whether a character class [...] (xgrammar's or GBNF's syntax) holds a character; True when in doubt."""
    body = text[1:-1]
    negated = body.startswith("^")
    if not negated:
        return body != ""
    chars = _class_chars(body[1:])
    if chars is None:
        return True
    # all of it left out, surrogates aside (UTF-8 cannot carry them)
    return not (_covers(chars, 0, 0xD7FF) and _covers(chars, 0xE000, _MAX))


def _covers(chars: list[tuple[int, int]], start: int, stop: int) -> bool:
    at = start
    for lo, hi in sorted(chars):
        if hi < at:
            continue
        if lo > at:
            return False
        at = hi + 1
    return at > stop


def _class_chars(body: str) -> list[tuple[int, int]] | None:
    """The ranges of a class body (after "[^"), None when it holds something unknown."""
    points = []
    i = 0
    while i < len(body):
        c, i = _class_char(body, i)
        if c is None:
            return None
        points.append(c)
        if i + 1 < len(body) and body[i] == "-":
            hi, j = _class_char(body, i + 1)
            if hi is None:
                return None
            points[-1] = (c[0], hi[0])
            i = j
    return points


def _class_char(body: str, i: int) -> tuple[tuple[int, int] | None, int]:
    if body[i] != "\\":
        return (ord(body[i]), ord(body[i])), i + 1
    if i + 1 >= len(body):
        return None, i + 1
    e = body[i + 1]
    width = {"x": 2, "u": 4, "U": 8}.get(e)
    if width:
        digits = body[i + 2 : i + 2 + width]
        if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
            return None, i + 2
        c = int(digits, 16)
        return (c, c), i + 2 + width
    if e in "dDwWsSpP":  # a shorthand class inside: not modelled
        return None, i + 2
    c = _ESCAPES.get(e, ord(e))
    return (c, c), i + 2


def shortest_lengths(rules: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """Each rule's shortest derivation in characters (rules with none left out: they are the
    unproductive ones), and (rule, length) of every part of every rule that derives something (a part
    inside x{m} counts once, x{m} as m times it). Knuth's generalisation of Dijkstra: a part is never
    shorter than what it is made of, so each one settles once, shortest first: n log n in the size of
    the grammar, whatever its order or nesting (a rule checked again at each change was quadratic:
    a root over 12,500 rules took 75 s). Lengths are capped at CAP."""
    kinds: list[str] = []  # per node: "seq", "alt", "rep", "ref" or "leaf"
    owner: list[str] = []  # the rule a node is in
    up: list[int] = []  # its parent node (-1: the top of its rule)
    need: list[int] = []  # seq: parts not settled yet; rep: the count
    total: list[int] = []  # seq: the settled parts' lengths
    users: dict[str, list[int]] = {name: [] for name in rules}  # rule -> the ref nodes naming it
    tops: dict[str, int] = {}
    heap: list[tuple[int, int]] = []
    for name, body in rules.items():
        work = [(body, -1)]
        while work:
            node, parent = work.pop()
            i = len(kinds)
            owner.append(name)
            up.append(parent)
            need.append(0)
            total.append(0)
            if parent < 0:
                tops[name] = i
            if node is _NEVER:
                kinds.append("leaf")
            elif isinstance(node, int):
                kinds.append("leaf")
                heap.append((min(node, CAP), i))
            elif node[0] == "ref":
                kinds.append("ref")
                if node[1] in users:
                    users[node[1]].append(i)
                else:  # an unknown name: not ours to judge
                    heap.append((0, i))
            elif node[0] == "rep":
                kinds.append("rep")
                need[i] = node[1]
                work.append((node[2], i))
            else:
                kinds.append(node[0])
                need[i] = len(node[1])
                if node[0] == "seq" and not node[1]:
                    heap.append((0, i))
                work.extend((child, i) for child in node[1])
    heapq.heapify(heap)
    settled: dict[int, int] = {}
    while heap:
        length, i = heapq.heappop(heap)
        if i in settled:
            continue
        settled[i] = length
        for p in users[owner[i]] if up[i] < 0 else (up[i],):
            if p in settled:
                continue
            if kinds[p] == "seq":
                need[p] -= 1
                total[p] = min(total[p] + length, CAP)
                if need[p] == 0:
                    heapq.heappush(heap, (total[p], p))
            elif kinds[p] == "rep":
                heapq.heappush(heap, (min(need[p] * length, CAP), p))
            else:  # alt: its shortest part; ref: its rule's
                heapq.heappush(heap, (length, p))
    rule_lengths = {name: settled[i] for name, i in tops.items() if i in settled}
    return rule_lengths, [(owner[i], n) for i, n in settled.items()]


def longest_needed(text: str) -> int:
    """The most characters that some part of an EBNF grammar (the request's or xgrammar's normalized
    text), reachable from its root, needs before it can end: x{1000000} needs a million, and so does
    a rule `r0 ::= r1 r1` twenty levels over "a". Once decoding is inside such a part, its whole rest
    is forced, and jump-forward computes that in one call. 0 when the text cannot be read."""
    try:
        rules, order = _parse(text)
    except (_Unreadable, RecursionError):
        return 0
    reach = set(_reachable(rules, "root" if "root" in rules else order[0]))
    _, parts = shortest_lengths(rules)
    return max((n for rule, n in parts if rule in reach), default=0)


def _reachable(rules: dict[str, Any], root: str) -> list[str]:
    """The rules reachable from root, breadth first (the nearest first)."""
    seen, queue = {root}, [root]
    for name in queue:
        for ref in _refs(rules[name]):
            if ref in rules and ref not in seen:
                seen.add(ref)
                queue.append(ref)
    return queue


def _refs(node: Any) -> list[str]:
    out, work = [], [node]
    while work:
        n = work.pop()
        if n is _NEVER or isinstance(n, int):
            continue
        if n[0] == "ref":
            out.append(n[1])
        elif n[0] == "rep":
            work.append(n[2])
        else:
            work.extend(reversed(n[1]))
    return out


def schema_never_ends(schema: Any) -> str | None:
    """Why a JSON schema admits no finite value, or None: a schema false, or a $ref cycle through
    required properties (or array items with minItems) that no alternative leaves. Anything it does
    not model counts as satisfiable."""
    try:
        return _SchemaCheck(schema).run()
    except (RecursionError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


class _SchemaCheck:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.ok: dict[str, bool] = {}  # $ref pointer -> satisfiable (least fixed point)

    def run(self) -> str | None:
        pointers = self._reachable_refs()
        self.ok = {p: False for p in pointers}
        changed = True
        while changed:
            changed = False
            for p in pointers:
                if not self.ok[p] and self._sat(pointer(self.root, p), 0):
                    self.ok[p] = changed = True
        if not self._sat(self.root, 0):
            return "sampling_params.json_schema is invalid: the schema admits no finite JSON value"
        bad = [p for p in pointers if not self.ok[p]]
        if bad:
            where = bad[0] if bad[0] != "#" else "# (the root)"
            return (f"sampling_params.json_schema is invalid: the schema at {where} admits no finite JSON "
                    "value (it requires itself with no way out)")  # fmt: skip
        return None

    def _reachable_refs(self) -> list[str]:
        found: dict[str, None] = {}  # (ordered)
        work = [self.root]
        while work:
            node = work.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#") and ref not in found:
                    target = pointer(self.root, ref)
                    if target is not None:
                        found[ref] = None
                        work.append(target)
                for key, value in node.items():
                    if key not in ("enum", "const", "default", "examples", "$defs", "definitions"):
                        work.append(value)
            elif isinstance(node, list):
                work.extend(node)
        return list(found)

    def _sat(self, node: Any, depth: int) -> bool:
        if depth > 200:
            return True
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in self.ok and not self.ok[ref]:
            return False
        for key in ("anyOf", "oneOf"):
            alts = node.get(key)
            if isinstance(alts, list) and alts and not any(self._sat(a, depth + 1) for a in alts):
                return False
        if isinstance(node.get("allOf"), list) and not all(self._sat(a, depth + 1) for a in node["allOf"]):
            return False
        kinds = node.get("type")
        if kinds == "object" or kinds == ["object"]:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            extra = node.get("additionalProperties", True)
            for name in node.get("required") or []:
                if not self._sat(props[name] if name in props else extra, depth + 1):
                    return False
        if kinds == "array" or kinds == ["array"]:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            items = node.get("items", True)
            for i in range(min(int(node.get("minItems") or 0), len(prefix) + 1)):
                if not self._sat(prefix[i] if i < len(prefix) else items, depth + 1):
                    return False
        return True


def never_ends(kind: str, text: str) -> str | None:
    """Why a request's grammar (kind, text) accepts no finite string, or None; needs no grammar library
    (the gateway's check and the llguidance backend)."""
    if kind == "regex":
        from shared.grammar_regex import python_regex

        if python_regex(text).empty:
            return "sampling_params.regex is invalid: the regex accepts no string"
        return None
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError:
            return None
        return schema_never_ends(schema)
    if kind == "ebnf":
        return grammar_never_ends(kind, text)
    return None
