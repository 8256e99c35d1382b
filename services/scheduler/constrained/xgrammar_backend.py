"""The grammar backend on xgrammar (regex, JSON schema, EBNF), SGLang's default.

Chosen by default when it is installed: a decode batch's masks cost ~14 us a row on 2 CPU cores here
against ~160 us with llguidance, whose batched fill did not scale with threads
(`python -m benchmarks.grammar_batch`, docs/benchmarks.md); at batch 256 on the H200 llguidance's
masks took 74% of a constrained step. Its jump-forward gives the forced string, tokenized here with
the model's tokenizer (`tokenizers`) and retokenized with the output's tail by jump_forward.py
(xgrammar's own `find_jump_forward_tokens` stops short of a last token that could grow, which saved
fewer forward passes on the JSON tests). Token bytes come from xgrammar's decoded vocabulary, so the
retokenizer and the masks read the vocabulary alike.
"""

from __future__ import annotations

import json
import os
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
from shared.grammar_text import KINDS

_LENGTH_LIMITED_CHAR = r"[^\"\\\r\n]"  # one character of a string with maxLength, as xgrammar writes it
_JSON_CHAR = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped
# a step's tokens go to the matchers in batched calls that release the GIL, split over this many
# threads (at least _ACCEPT_ROWS rows each): one accept walks the token's bytes through the grammar,
# ~4-25 us a token, which at hundreds of rows was the largest host cost of a constrained step
_ACCEPT_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
_ACCEPT_ROWS = 32
_accept_pool: ThreadPoolExecutor | None = None


class XGrammarMatcher(Matcher):
    def __init__(self, m, backend: XGrammarBackend) -> None:  # an xgrammar.GrammarMatcher
        self._m, self._backend = m, backend
        self._error = ""

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
    def accept_batch(matchers: list[Matcher], tokens: list[int]) -> list[bool]:
        """One token each (refused: the matcher is unchanged and says why), on up to _ACCEPT_THREADS
        threads at once."""
        global _accept_pool
        batch = matchers[0]._backend.xgr.BatchGrammarMatcher.batch_accept_token  # type: ignore[attr-defined]
        ms = [m._m for m in matchers]  # type: ignore[attr-defined]
        parts = min(_ACCEPT_THREADS, max(1, len(ms) // _ACCEPT_ROWS))
        if parts == 1:
            ok = batch(ms, tokens)
        else:
            if _accept_pool is None:
                _accept_pool = ThreadPoolExecutor(_ACCEPT_THREADS, thread_name_prefix="grammar-accept")
            size = -(-len(ms) // parts)
            chunks = [(ms[i : i + size], tokens[i : i + size]) for i in range(0, len(ms), size)]
            ok = [x for part in _accept_pool.map(lambda c: batch(*c), chunks) for x in part]
        for m, t, good in zip(matchers, tokens, ok, strict=True):
            if not good:
                m._error = f"token {t} is not allowed here"  # type: ignore[attr-defined]
        return ok

    def accept(self, tokens: list[int]) -> bool:
        for i, t in enumerate(tokens):
            if not self._m.accept_token(t):
                self._error = f"token {t} is not allowed here"
                if i:
                    self._m.rollback(i)
                return False
        return True

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def forced(self) -> list[int]:
        text = self._m.find_jump_forward_string()
        return self._backend.encode(text) if text else []

    @property
    def done(self) -> bool:
        """Terminated, or complete with nothing but a stop token allowed next (xgrammar's is_terminated
        waits for the stop token itself): the mask's words with the stop tokens' bits cleared are 0."""
        if self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False
        row = torch.zeros((self._backend.vocab_size + 31) // 32, dtype=torch.int32)
        self.fill_bitmask(row)
        for t in self._m.stop_token_ids:
            if t < self._backend.vocab_size:
                row[t // 32] &= ~(1 << (t % 32)) if t % 32 < 31 else 0x7FFFFFFF
        return not bool(row.any())

    @property
    def error(self) -> str:
        return self._error


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
        self._tok = tokenizers.Tokenizer.from_str(tokenizer_text(tokenizer_json))
        hf = PreTrainedTokenizerFast(tokenizer_object=self._tok)
        known = [t for t in eos_ids if t < self._tok.get_vocab_size(with_added_tokens=True)]
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=known or None
        )
        self._bytes = [b"" if t is None else t for t in info.decoded_vocab]
        self._special = set(info.special_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # GrammarCache caches
        self.batcher = xgrammar.BatchGrammarMatcher()
        self.vocab_size = vocab_size
        check_round_trip(lambda text: self.decode_bytes(self.encode(text)), tokenizer_json)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return b"".join(self._bytes[t] if t < len(self._bytes) else b"" for t in tokens)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        c = self.compiler
        try:
            if spec.kind == "regex":
                compiled = c.compile_regex(spec.text)
            elif spec.kind == "json_schema":
                try:
                    json.loads(spec.text)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"sampling_params.json_schema is not JSON: {e}") from None
                # xgrammar 0.2.9 lets a string with maxLength hold raw control characters, which
                # JSON forbids (json.loads refuses them): its grammar text, with them excluded
                grammar = self.xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
                compiled = c.compile_grammar(str(grammar).replace(_LENGTH_LIMITED_CHAR, _JSON_CHAR))
            elif spec.kind == "ebnf":
                compiled = c.compile_grammar(spec.text)
            else:
                raise GrammarError(f"unknown grammar kind {spec.kind!r}; allowed: {', '.join(KINDS)}")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar's parse errors (RuntimeError, ValueError)
            message = " ".join(str(e).split())[:500]
            raise GrammarError(f"sampling_params.{spec.kind} is invalid: {message}") from None
        return XGrammarGrammar(compiled, self)

    def retokenize(self, tokens: list[int]) -> list[int] | None:
        if any(t in self._special or t >= len(self._bytes) for t in tokens):
            return None
        data = self.decode_bytes(tokens)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        new = self.encode(text)
        return new if self.decode_bytes(new) == data else None
