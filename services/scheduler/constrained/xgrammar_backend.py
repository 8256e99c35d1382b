"""The grammar backend on xgrammar (regex, JSON schema, EBNF), SGLang's default.

Chosen by default when it is installed: a decode batch's masks cost ~14 us a row on 2 CPU cores here
against ~160 us with llguidance, whose batched fill did not scale with threads
(`python -m benchmarks.grammar_batch`, docs/benchmarks.md); at batch 256 on the H200 llguidance's
masks took 74% of a constrained step. Its jump-forward gives the forced string, tokenized here with
the model's tokenizer (`tokenizers`) and retokenized with the output's tail by jump_forward.py
(xgrammar's own `find_jump_forward_tokens` stops short of a last token that could grow, which saved
fewer forward passes on the JSON tests). Token bytes come from xgrammar's decoded vocabulary, so the
retokenizer and the masks read the vocabulary alike.

The tokenizer's special tokens (tokenizer.json's added tokens marked special: <|endoftext|>,
<|im_start|>, <|im_end|>, ...) are given to xgrammar as special, never as text: otherwise a JSON
string or a regex's `.` takes them, and an end token counts as the ten characters of its name. A
request's regex is given as Python's `re` reads it (grammar_regex.py) and its JSON schema without the
keywords xgrammar would silently ignore (grammar_schema.py: refused, or rewritten where that is plain);
xgrammar's normalized grammar is then checked for rules that never end (grammar_finite.py) before it compiles.

xgrammar has no limits of its own, and its compile holds the GIL (the step loop ran at a fifth of its
pace beside one): `prepare` runs in the compile worker (admission.py), checks, and compiles once as a
trial that its timeout kills (a 551-character regex took 74 s), refusing one past 64 MB in memory;
`load` compiles it again here, which took about as long there, within the timeout. (Handing the
compiled grammar over costs more: a 300-property schema that compiles in 0.07 s serializes to 94 MB,
which took 4.7 s to load.) Its jump-forward string is computed whole, on the step loop: the
normalized grammar is refused when a part of it needs more than 100,000 characters (grammar_limits.py:
2^40 forced characters allocated 18 GB in a minute), and a repeat with a large minimum and no maximum,
`x{m,}` (a JSON array's minItems), goes to xgrammar as `x{m,m} x*`, which means the same: its forced
string took time quadratic in m (26 s for minItems 10,000; 30 ms for 100,000 so written).
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from services.scheduler.constrained.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarSpec,
    Matcher,
    check_round_trip,
    tokenizer_text,
)
from shared.grammar_finite import grammar_never_ends, longest_needed
from shared.grammar_limits import check_grammar_cost, check_needed
from shared.grammar_regex import python_regex
from shared.grammar_schema import load_schema, xgrammar_schema
from shared.grammar_text import KINDS

_LENGTH_LIMITED_CHAR = r"[^\"\\\r\n]"  # one character of a string with maxLength, as xgrammar writes it
_JSON_CHAR = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped
# a step's tokens go to the matchers in batched calls that release the GIL, split over this many
# threads (at least _ACCEPT_TOKENS tokens each): one accept walks the token's bytes through the grammar,
# ~1 us a token (~7 us when a padded vocabulary made special tokens of its padding), so one token a row
# stays on one thread: 256 rows took 0.25 ms in one call and 0.46 ms split in two (cpu2); jump-forward's
# many tokens a row are worth the threads
_ACCEPT_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
_ACCEPT_TOKENS = 256
_accept_pool: ThreadPoolExecutor | None = None
_ENCODE_CACHE = 1 << 16  # texts whose tokens are kept (forced strings, retokenized tails)
_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")  # "[09:24:51] /project/cpp/x.cc:94: " in messages
MAX_COMPILED_BYTES = 64 << 20  # a compiled grammar's memory (its adaptive token masks), 57 MB serialized
_UNBOUNDED_FROM = 16  # x{m,} with m from here on is given as x{m,m} x*
# the normalized grammar a token at a time: a literal, a class, a name (maybe with a repeat {m, -1}), or
# any other character, so that nothing inside a literal or a class is read as a repeat
_ATOM = re.compile(
    r'("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][\w.\-]*)(?:\{(\d+), -1\})?|.', re.DOTALL
)


class XGrammarMatcher(Matcher):
    def __init__(self, m, backend: XGrammarBackend) -> None:  # an xgrammar.GrammarMatcher
        self._m, self._backend = m, backend
        self._error = ""

    @property
    def mask_words(self) -> int:
        return self._backend.mask_words

    def fill_bitmask(self, row: torch.Tensor) -> None:
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._m.fill_next_token_bitmask(row.view(1, -1), 0)

    @staticmethod
    def fill_batch(matchers: list[Matcher], out: torch.Tensor, rows: list[int]) -> None:
        """All rows in one call on xgrammar's threads (the GIL released): matchers[j] fills out[rows[j]]."""
        assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
        first = matchers[0]
        assert isinstance(first, XGrammarMatcher)
        ms = [m._m for m in matchers]  # type: ignore[attr-defined]
        first._backend.batcher.batch_fill_next_token_bitmask(ms, out, rows)

    @staticmethod
    def accept_batch(matchers: list[Matcher], seqs: list[list[int]]) -> list[bool]:
        """matchers[j] takes all of seqs[j] or none (refused: unchanged, and it says why): the rows
        split over up to _ACCEPT_THREADS threads, each taking its rows' tokens in rounds of one
        batched call (the k-th token of every row still going)."""
        global _accept_pool
        ms = [m._m for m in matchers]  # type: ignore[attr-defined]
        parts = min(_ACCEPT_THREADS, max(1, sum(map(len, seqs)) // _ACCEPT_TOKENS), len(ms))
        if parts <= 1:
            refused = _accept_rounds(ms, seqs)
        else:
            if _accept_pool is None:
                _accept_pool = ThreadPoolExecutor(_ACCEPT_THREADS, thread_name_prefix="grammar-accept")
            size = -(-len(ms) // parts)
            chunks = [(ms[i : i + size], seqs[i : i + size]) for i in range(0, len(ms), size)]
            refused = [x for part in _accept_pool.map(lambda c: _accept_rounds(*c), chunks) for x in part]
        for m, t in zip(matchers, refused, strict=True):
            if t is not None:
                m._error = f"token {t} is not allowed here"  # type: ignore[attr-defined]
        return [t is None for t in refused]

    def accept(self, tokens: list[int]) -> bool:
        return self.accept_batch([self], [tokens])[0]

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def forced(self) -> list[int]:
        return self.forced_batch([self])[0]

    @staticmethod
    def forced_batch(matchers: list[Matcher]) -> list[list[int]]:
        """The forced strings, tokenized in one call."""
        texts = [m._m.find_jump_forward_string() for m in matchers]  # type: ignore[attr-defined]
        some = [t for t in texts if t]
        if not some:
            return [[] for _ in texts]
        encoded = iter(matchers[0]._backend.encode_all(some))  # type: ignore[attr-defined]
        return [next(encoded) if t else [] for t in texts]

    @property
    def done(self) -> bool:
        """Terminated, or complete with nothing but a stop token allowed next (xgrammar's is_terminated
        waits for the stop token itself): the mask's words with the stop tokens' bits cleared are 0."""
        if not self._m._handle.is_completed():  # (a terminated matcher is complete too): one call for
            return False  # most rows, past xgrammar's wrapper
        return self._complete_done()

    @staticmethod
    def done_batch(matchers: list[Matcher]) -> list[bool]:
        """`done` of each: one ffi call for each row that is not complete yet (most of them)."""
        return [m._m._handle.is_completed() and m._complete_done() for m in matchers]  # type: ignore[attr-defined]

    def _complete_done(self) -> bool:
        if self._m.is_terminated():
            return True
        row = torch.zeros((self._backend.vocab_size + 31) // 32, dtype=torch.int32)
        self.fill_bitmask(row)
        for t in self._m.stop_token_ids:
            if t < self._backend.vocab_size:
                row[t // 32] &= ~(1 << (t % 32)) if t % 32 < 31 else 0x7FFFFFFF
        return not bool(row.any())

    @property
    def error(self) -> str:
        return self._error


def _batch_accept(ms: list, tokens: list[int]) -> list[int]:
    """xgrammar's batched accept (GIL released), its result read as one slice: the public wrapper
    reads the tvm-ffi array an element at a time (~1 us each in Python, a tenth of a millisecond per
    256 rows of every round), the slice in one loop of ffi calls. Truthy per row: accepted."""
    import xgrammar

    core = getattr(getattr(xgrammar, "matcher", None), "_core", None)
    if core is None:  # another xgrammar layout: its public wrapper
        return xgrammar.BatchGrammarMatcher.batch_accept_token(ms, tokens)
    return core.BatchGrammarMatcher.batch_accept_token([m._handle for m in ms], tokens, False)[:]


def _accept_rounds(ms: list, seqs: list[list[int]]) -> list[int | None]:
    """xgrammar matchers ms[j] take all of seqs[j] or none, the k-th tokens of all rows in one call
    (it releases the GIL); a row refused rolls back what it took. Per row: the token refused, or None."""
    batch = _batch_accept
    refused: list[int | None] = [None] * len(ms)
    for k in range(max(map(len, seqs), default=0)):
        rows = [j for j, s in enumerate(seqs) if refused[j] is None and len(s) > k]
        if not rows:
            break
        for j, good in zip(rows, batch([ms[j] for j in rows], [seqs[j][k] for j in rows]), strict=True):
            if not good:
                refused[j] = seqs[j][k]
                if k:
                    ms[j].rollback(k)
    return refused


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled, backend: XGrammarBackend) -> None:
        self._compiled, self._backend = compiled, backend

    def matcher(self) -> Matcher:
        return XGrammarMatcher(self._backend.xgr.GrammarMatcher(self._compiled), self._backend)


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        import tokenizers
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        # the byte-level decoder made plain (see tokenizer_text), so xgrammar detects the vocabulary
        text = tokenizer_text(tokenizer_json)
        self._tok = tokenizers.Tokenizer.from_str(text)
        hf = PreTrainedTokenizerFast(tokenizer_object=self._tok)
        # the grammar's vocabulary ends with the tokenizer's tokens: ids of a model's vocabulary padded
        # past them are never text, and xgrammar takes each for a special token, which it looks up on
        # every accept (49,152 tokens in a 128,256 vocabulary: ~10x the cost of an accept, 0.7 -> 6.8 us)
        vocab_size = min(vocab_size, max(hf.get_vocab().values(), default=-1) + 1)
        known = [t for t in eos_ids if t < vocab_size]
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=known or None
        )
        added = _added_tokens(text)
        special = {t for t, (_, is_special) in added.items() if is_special}
        info = _with_special_tokens(xgrammar, info, hf.get_vocab(), special, vocab_size)
        self._bytes = [b"" if t is None else t for t in info.decoded_vocab]
        for t, (content, _) in added.items():  # blanked for xgrammar: their text here
            if t < len(self._bytes) and not self._bytes[t]:
                self._bytes[t] = content.encode()
        self._special = set(info.special_token_ids) | special | set(info.stop_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # GrammarCache caches
        self.batcher = xgrammar.BatchGrammarMatcher()
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self._encoded: dict[str, list[int]] = {}
        check_round_trip(lambda text: self.decode_bytes(self.encode(text)), tokenizer_json)

    def encode(self, text: str) -> list[int]:
        return self.encode_all([text])[0]

    def encode_all(self, texts: list[str]) -> list[list[int]]:
        """The tokens of each text: from a cache of recent ones (a forced string such as a JSON key
        recurs in every request of a schema; ~20 us to tokenize here), the rest in one call."""
        cache = self._encoded
        todo = list({t for t in texts if t not in cache})
        if todo:
            if len(cache) + len(todo) > _ENCODE_CACHE:
                cache.clear()
            fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # tokenizers < 0.21
            for text, e in zip(todo, fast(todo, add_special_tokens=False), strict=True):
                cache[text] = e.ids
        return [list(cache[t]) for t in texts]

    def vocab_bytes(self) -> list[bytes | None]:
        return list(self._bytes[: self.vocab_size])

    def decode_bytes(self, tokens: list[int]) -> bytes:
        """The tokens' bytes (a special token's: its text; one past the vocabulary: none). A retokenized
        tail is decoded each step a row jumps, so the common case is one `map` over the table, not a
        Python loop."""
        table = self._bytes
        if not tokens or max(tokens) < len(table):
            return b"".join(map(table.__getitem__, tokens))
        return b"".join(table[t] if t < len(table) else b"" for t in tokens)

    def prepare(self, spec: GrammarSpec) -> tuple[str, str, str | None]:
        """Prepared for xgrammar (ours: a 400 naming the field), parsed, its normalized grammar checked
        for rules that never end (their jump-forward string is endless) or that force too much,
        compiled; (kind, what xgrammar parses, the grammar text to compile instead or None) for `load`."""
        if spec.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}; allowed: {', '.join(KINDS)}")
        try:
            check_grammar_cost(spec.kind, spec.text)
            source = _source(spec)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        try:
            grammar = self._parsed(spec.kind, source)
            text = str(grammar)
        except Exception as e:  # xgrammar's parse errors (RuntimeError)
            raise GrammarError(f"sampling_params.{spec.kind} is invalid: {library_message(e)}") from None
        why = grammar_never_ends(spec.kind, text)
        if why:
            raise GrammarError(why)
        try:
            check_needed(spec.kind, longest_needed(text))
        except ValueError as e:
            raise GrammarError(str(e)) from None
        # xgrammar 0.2.9 lets a string with maxLength hold raw control characters, which JSON forbids
        # (json.loads refuses them): its grammar text, with them excluded
        own = text.replace(_LENGTH_LIMITED_CHAR, _JSON_CHAR) if spec.kind == "json_schema" else text
        own = bounded_repeats(own)
        # the parsed grammar when its text changed nothing: its str() writes a "\0" as "" (a regex's \x00)
        size = self._compiled(spec.kind, grammar if own == text else own).memory_size_bytes
        if size > MAX_COMPILED_BYTES:
            raise GrammarError(f"sampling_params.{spec.kind} compiles to {size >> 20} MB; at most "
                               f"{MAX_COMPILED_BYTES >> 20} MB (fewer distinct parts)")  # fmt: skip
        return spec.kind, source, None if own == text else own

    def load(self, prepared: object) -> CompiledGrammar:
        kind, source, own = prepared  # type: ignore[misc]
        return XGrammarGrammar(self._compiled(kind, self._parsed(kind, source) if own is None else own), self)

    def _parsed(self, kind: str, source: str):
        g = self.xgr.Grammar
        parse = {"regex": g.from_regex, "ebnf": g.from_ebnf}.get(kind)
        return parse(source) if parse else g.from_json_schema(source, any_whitespace=False)

    def _compiled(self, kind: str, grammar):
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as e:
            raise GrammarError(f"sampling_params.{kind} is invalid: {library_message(e)}") from None

    def retokenize(self, tokens: list[int]) -> list[int] | None:
        return self.retokenize_all([tokens])[0]

    def retokenize_all(self, seqs: list[list[int]]) -> list[list[int] | None]:
        datas: list[bytes | None] = []
        texts = []
        for tokens in seqs:
            data = None
            if self._special.isdisjoint(tokens) and (not tokens or max(tokens) < len(self._bytes)):
                data = self.decode_bytes(tokens)
                try:
                    texts.append(data.decode("utf-8"))
                except UnicodeDecodeError:
                    data = None
            datas.append(data)
        encoded = iter(self.encode_all(texts) if texts else [])
        out: list[list[int] | None] = []
        for data in datas:
            new = next(encoded) if data is not None else None
            ok = new is not None and self._special.isdisjoint(new) and self.decode_bytes(new) == data
            out.append(new if ok else None)
        return out


def _source(spec: GrammarSpec) -> str:
    """What xgrammar is given for the request's grammar: a regex as Python reads it, a JSON schema
    without the keywords xgrammar would ignore; ValueError naming the field."""
    if spec.kind == "regex":
        return python_regex(spec.text).text
    if spec.kind == "json_schema":
        return json.dumps(xgrammar_schema(load_schema(spec.text)))
    return spec.text


def bounded_repeats(ebnf: str) -> str:
    """xgrammar's normalized grammar with each `x{m, -1}` (m >= _UNBOUNDED_FROM) whose x matches just
    one string written `x{m, m} x*`. Only those: their jump-forward walks all m copies (quadratic in m),
    while a repeat of a class is not forced, and xgrammar compiles it as it is far faster (0.01 s
    against 0.4 s for a string's minLength 20)."""
    if ", -1}" not in ebnf:
        return ebnf
    fixed = _one_string_rules(ebnf)
    out = []
    for t in _ATOM.finditer(ebnf):
        atom, least = t.group(1), t.group(2)
        if least is not None and int(least) >= _UNBOUNDED_FROM and (atom[0] == '"' or atom in fixed):
            out.append(f"{atom}{{{least}, {least}}} {atom}*")
        else:
            out.append(t.group())
    return "".join(out)


def _one_string_rules(ebnf: str) -> set[str]:
    """The rules of a normalized grammar (one a line) that match exactly one string: their bodies are
    literals, groups and such rules (no alternative, class, repeat or recursion; a closing lookahead
    aside). Each rule is settled once, after the rules it uses (linear in the grammar)."""
    waits: dict[str, set[str]] = {}  # a rule made of literals and names -> the names not settled yet
    for line in ebnf.splitlines():
        name, sep, body = line.partition(" ::= ")
        if not sep:
            continue
        names, plain = set(), True
        for t in _ATOM.finditer(body):
            x = t.group()
            if t.group(2) is not None or x[0] in "[|*+?{":
                plain = False
                break
            if x == "(" and body[t.end() : t.end() + 1] == "=":  # the lookahead that ends a rule
                break
            if t.group(1) is not None and x[0] != '"':
                names.add(x)
        if plain:
            waits[name.strip()] = names
    users: dict[str, list[str]] = {}
    for name, names in waits.items():
        for n in names:
            users.setdefault(n, []).append(name)
    done = [n for n, names in waits.items() if not names]
    fixed = set(done)
    while done:
        settled = done.pop()
        for user in users.get(settled, ()):
            waits[user].discard(settled)
            if not waits[user] and user not in fixed:
                fixed.add(user)
                done.append(user)
    return fixed


def library_message(e: Exception) -> str:
    """xgrammar's message on one line, without the C++ log prefix ("[09:24:51] /project/cpp/x.cc:94: ")."""
    return " ".join(_LOG_PREFIX.sub("", str(e)).split())[:500]


def _added_tokens(tokenizer_json: str) -> dict[int, tuple[str, bool]]:
    """tokenizer.json's added tokens: id -> (text, marked special)."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    return {
        t["id"]: (t["content"], bool(t.get("special")))
        for t in added
        if isinstance(t.get("id"), int) and isinstance(t.get("content"), str)
    }


def _with_special_tokens(xgrammar, info, vocab: dict[str, int], special: set[int], vocab_size: int):
    """`info` with the special tokens known as such: xgrammar takes a token whose text is empty for a
    special one (never allowed as text), and from_huggingface keeps the text of every token, so the
    vocabulary is given again with those blanked. A stop token is blanked too: xgrammar also matches
    a stop token's text (an end token was taken as the ten characters "<|im_end|>" of a regex), and
    it still allows it, as a stop token, where the grammar may end."""
    blank = special | set(info.stop_token_ids)
    if not blank:
        return info
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size and idx not in blank:
            encoded[idx] = token
    return xgrammar.TokenizerInfo(
        encoded,
        info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(info.stop_token_ids),
        add_prefix_space=info.add_prefix_space,
    )
