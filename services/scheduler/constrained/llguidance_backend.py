"""The grammar backend on llguidance (regex, JSON schema, EBNF via its GBNF-to-Lark converter).

Chosen over xgrammar for now because it has no dependencies to carry to the lent GPU (one 3 MB abi3
wheel; xgrammar needs apache-tvm-ffi, pydantic, transformers), its masks take ~30 us for a JSON
schema on the default model here, and its fast-forward tokens come canonically tokenized
(`compute_ff_tokens`), which jump-forward needs. A pristine matcher per grammar is cached; each
request gets a deep copy (cheaper than building it again). A grammar that accepts no finite string is
refused at compile (grammar_finite.py), as in the gateway; should one get past that (a Lark grammar, which
the check does not read), llguidance's parser gives up on it ("Too many items"), and the request ends
with a 400 that says so, without llguidance's parser dump.

Its cost is bounded by llguidance's own limits besides our checks (grammar_limits.py) and the compile's
timeout: `LLParserLimits` gives the lexer fuel to build (1,000,000, ~20 ms) and per mask (200,000,
~14 ms), at most 50,000 Earley items a step, 250,000 lexer states and 500,000 grammar symbols; past
one the matcher errs and its request ends. Its forced tokens stop by themselves (`compute_ff_tokens`
gave at most ~62,500 tokens for a million forced characters, in 0.4 s).
`prepare` (in the compile worker) checks the grammar and builds a matcher once; `load` builds it again
from the grammar text here, which finished within the timeout there (it releases the GIL meanwhile).
"""

from __future__ import annotations

import json

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
from shared.grammar_finite import never_ends
from shared.grammar_limits import check_grammar_cost
from shared.grammar_text import grammar_text, one_line

_EXECUTOR = None
_GAVE_UP = "Too many items"  # llguidance's parser on an endless forced string (a grammar with no end)


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


class LLGuidanceMatcher(Matcher):
    def __init__(self, m, mask_words: int) -> None:  # an llguidance.LLMatcher
        self._m, self._words = m, mask_words
        self._refused = ""

    @property
    def mask_words(self) -> int:
        return self._words

    @property
    def error_status(self) -> int:
        return 400 if self._m.is_error() and _GAVE_UP in self._m.get_error() else 500

    def fill_bitmask(self, row: torch.Tensor) -> None:
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    @staticmethod
    def fill_batch(matchers: list[Matcher], out: torch.Tensor, rows: list[int]) -> None:
        """All rows at once on llguidance's thread pool (the GIL released): a mask takes ~45 us on the
        default model, so 256 of them one after the other would be ~12 ms of every step."""
        assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
        pairs = [(m._m, j) for j, m in zip(rows, matchers, strict=True)]  # type: ignore[attr-defined]
        _executor().unsafe_compute_mask_ptr(pairs, out.data_ptr(), out.shape[1] * 4, out.shape[0])

    def accept(self, tokens: list[int]) -> bool:
        n = self._m.validate_tokens(tokens)  # consume_tokens would take the valid ones before a refusal
        if n < len(tokens):
            self._refused = f"token {tokens[n]} is not allowed here"
            return False
        return self._m.consume_tokens(tokens)

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise GrammarError(f"cannot roll back {n} tokens: {self._m.get_error()}")

    def forced(self) -> list[int]:
        return self._m.compute_ff_tokens()

    @property
    def done(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        if not self._m.is_error():
            return self._refused
        error = self._m.get_error()
        first = error.split("\n<state>")[0]  # the parser's state dump follows: not for a client
        if _GAVE_UP in first:
            return f"the grammar accepts no finite string here (llguidance: {one_line(first)[:200]})"
        return one_line(first)[:500]


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, pristine, mask_words: int) -> None:
        self._pristine, self._words = pristine, mask_words

    def matcher(self) -> Matcher:
        return LLGuidanceMatcher(self._pristine.deep_copy(), self._words)


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        import llguidance

        self._llg = llguidance
        text = tokenizer_text(tokenizer_json)
        try:
            self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_ids))
        except ValueError:  # an EOS id the tokenizer lacks (a config whose vocabulary is not the
            # tokenizer's, as a config-only folder with a borrowed tokenizer): the tokenizer's own EOS
            self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size)
        tok = self.tokenizer
        check_round_trip(lambda text: tok.decode_bytes(tok.tokenize_bytes(text.encode())), tokenizer_json)
        self.vocab_size = vocab_size
        # ids past the tokenizer's own (a model vocabulary padded past it) are never text
        data = json.loads(text)
        ids = [
            *((data.get("model") or {}).get("vocab") or {}).values(),
            *(t.get("id", -1) for t in data.get("added_tokens") or []),
        ]
        self._known = min(vocab_size, max((i for i in ids if isinstance(i, int)), default=vocab_size - 1) + 1)

    def prepare(self, spec: GrammarSpec) -> tuple[str, str]:
        """(kind, llguidance's grammar text), checked, its matcher built once."""
        try:
            check_grammar_cost(spec.kind, spec.text)
            text = grammar_text(spec.kind, spec.text)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        why = never_ends(spec.kind, spec.text)
        if why:
            raise GrammarError(why)
        error = self._llg.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(f"sampling_params.{spec.kind} is invalid: {one_line(error)}")
        self._matcher(spec.kind, text)
        return spec.kind, text

    def load(self, prepared: object) -> CompiledGrammar:
        kind, text = prepared  # type: ignore[misc]
        return LLGuidanceGrammar(self._matcher(kind, text), (self.vocab_size + 31) // 32)

    def _matcher(self, kind: str, text: str):
        m = self._llg.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise GrammarError(f"sampling_params.{kind} is invalid: {one_line(m.get_error())}")
        return m

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return self.tokenizer.decode_bytes(tokens)

    def vocab_bytes(self) -> list[bytes | None]:
        return [self.tokenizer.decode_bytes([t]) if t < self._known else None for t in range(self.vocab_size)]

    def retokenize(self, tokens: list[int]) -> list[int] | None:
        tok = self.tokenizer
        if any(tok.is_special_token(t) for t in tokens):
            return None
        data = tok.decode_bytes(tokens)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        new = tok.tokenize_bytes(data)
        if any(tok.is_special_token(t) for t in new):
            return None
        return new if tok.decode_bytes(new) == data else None
