"""The grammar-backend interface of constrained decoding.

    spec = GrammarSpec("json_schema", '{"type": "object", ...}')     also "regex", "ebnf"
    compiled = grammars.get(spec)          cached by (kind, text); compiled on a worker thread
    prepared = backend.prepare(spec)       the checks and a trial compile, in a worker process that a
    compiled = backend.load(prepared)      timeout kills (admission.py); then the compile here
    matcher = compiled.matcher()           one per request: its own parser state
    matcher.fill_bitmask(row)              allowed next tokens, one bit per token id (int32 words)
    matcher.accept(ts)                     advance over all of ts, or none: False when one is not allowed
    accept_sequences(matchers, seqs)       the same for many matchers at once (batched where the backend can)
    matcher.rollback(n)                    undo the last n accepted tokens
    matcher.forced()                       tokens the grammar forces next (jump-forward), maybe []
    forced_tokens(matchers)                the same for many matchers at once
    matcher.done                           the grammar can take nothing more but EOS
    done_flags(matchers)                   the same for many matchers at once
    matcher.grammar_now()                  the matcher constraining the next token (None: a grammar that
                                           waits for the end of the reasoning, reasoning_gate.py)
    matcher.undoable                       how many of its last tokens rollback may undo
    backend.decode_bytes(ts), vocab_bytes()  the tokens' bytes; every id's (None: never a token)

A grammar that does not compile raises GrammarError with the library's message (a 400 for the
request); a compile past `timeout_s` raises GrammarError too, and the request ends while the compile
runs on until its worker process is killed at the same timeout (the failure is cached: the same text
fails again at once).
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import torch

from shared.grammar_text import KINDS

log = logging.getLogger(__name__)
T = TypeVar("T")


class GrammarError(ValueError):
    """The grammar cannot be used: it does not parse, or compiling it took too long (a 400), or the
    grammar machinery failed on it (status_code 500)."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class GrammarSpec(NamedTuple):
    kind: str  # one of KINDS
    text: str


class Matcher(ABC):
    @abstractmethod
    def fill_bitmask(self, row: torch.Tensor) -> None:
        """row: int32 [mask_words] on the CPU; bit t of word t // 32 set when token t may come next."""

    @property
    @abstractmethod
    def mask_words(self) -> int:
        """The int32 words of a mask row: ceil(V / 32) for the grammar's vocabulary V, which may stop
        short of the model's (ids past V are never allowed)."""

    @abstractmethod
    def accept(self, tokens: list[int]) -> bool:
        """Take all of `tokens`, or none: False (and `error` says why) leaves the state unchanged."""

    @abstractmethod
    def rollback(self, n: int) -> None: ...

    @abstractmethod
    def forced(self) -> list[int]: ...

    @property
    @abstractmethod
    def done(self) -> bool: ...

    @property
    @abstractmethod
    def error(self) -> str:
        """Why the matcher refused a token ('' when it did not)."""

    @property
    def error_status(self) -> int:
        """The HTTP status of a request this matcher's `error` ends: 400 when the grammar is at fault
        (one that never ends), 500 when the grammar machinery is."""
        return 500

    def grammar_now(self) -> Matcher | None:
        """The matcher that constrains the next token: this one, or None while a grammar waits
        (reasoning_gate.py: every token allowed, nothing forced, nothing done)."""
        return self

    @property
    def undoable(self) -> int:
        """How many of the last tokens taken `rollback` may undo (a gate: only the grammar's)."""
        return 1 << 62

    def taken(self, n: int) -> None:
        """`grammar_now()`, another matcher, took n tokens on this one's behalf (a gate counts them)."""
        return None


def fill_bitmasks(matchers: list[Matcher], out: torch.Tensor, rows: list[int] | None = None) -> None:
    """Row rows[j] of `out` (row j without `rows`) gets matchers[j]'s mask, in one batched call when
    they share a backend that has one (`fill_batch`), else one by one; a waiting grammar's row allows
    every token that cannot end the wait with bytes the grammar would not see (reasoning_gate.py)."""
    rows = list(range(len(matchers))) if rows is None else rows
    live: list[Matcher] = []
    at: list[int] = []
    for j, m in zip(rows, matchers, strict=True):
        g = m.grammar_now()
        if g is None:
            m.fill_bitmask(out[j])
        else:
            live.append(g)
            at.append(j)
    batch = _batched(live, "fill_batch")
    if batch is not None:
        batch(live, out, at)
        return
    for j, m in zip(at, live, strict=True):
        m.fill_bitmask(out[j])


def accept_sequences(matchers: list[Matcher], seqs: list[list[int]]) -> list[bool]:
    """matchers[j] takes all of seqs[j] or none (as `Matcher.accept`): in batched calls when they
    share a backend that has them (`accept_batch`), else one by one. A gate whose grammar applies
    passes its tokens to its grammar's matcher in the batch; one still waiting takes them itself (they
    may end the reasoning and start the grammar)."""
    now = [m.grammar_now() for m in matchers]
    live = [j for j, g in enumerate(now) if g is not None]
    grammars: list[Matcher] = [g for g in now if g is not None]
    batch = _batched(grammars, "accept_batch")
    took = (
        batch(grammars, [seqs[j] for j in live])
        if batch is not None
        else [g.accept(seqs[j]) for g, j in zip(grammars, live, strict=True)]
    )
    out = [False] * len(matchers)
    for j, ok in zip(live, took, strict=True):
        out[j] = ok
        if ok and now[j] is not matchers[j]:
            matchers[j].taken(len(seqs[j]))
    for j, g in enumerate(now):
        if g is None:  # after the batch took its tokens: a gate that fails here refuses alone (a
            try:  # caller's retry one by one would hand the batch's rows their tokens again)
                out[j] = matchers[j].accept(seqs[j])
            except Exception:
                log.exception("a reasoning gate failed to take its tokens")
    return out


def forced_tokens(matchers: list[Matcher]) -> list[list[int]]:
    """Each matcher's `forced()` ([] while its grammar waits): in one batched call when they share a
    backend that has one (`forced_batch`), else one by one."""
    return _each_grammar(matchers, "forced_batch", lambda g: g.forced(), list)


def done_flags(matchers: list[Matcher]) -> list[bool]:
    """Each matcher's `done` (False while its grammar waits): in one call when they share a backend
    that has one (`done_batch`)."""
    return _each_grammar(matchers, "done_batch", lambda g: g.done, bool)


def _each_grammar(
    matchers: list[Matcher], batch_name: str, one: Callable[[Matcher], T], waiting: Callable[[], T]
) -> list[T]:
    """one(g) for each matcher's grammar_now() g, or the backend's batched call of that name over them
    all; waiting() where a grammar waits."""
    now = [m.grammar_now() for m in matchers]
    live = [g for g in now if g is not None]
    batch = _batched(live, batch_name)
    got = iter(batch(live) if batch is not None else [one(g) for g in live])
    return [next(got) if g is not None else waiting() for g in now]


def _batched(matchers: list[Matcher], name: str) -> Callable | None:
    kind = type(matchers[0]) if matchers else None
    batch = getattr(kind, name, None)
    return batch if batch is not None and all(type(m) is kind for m in matchers) else None


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> Matcher: ...


class Retokenizer(ABC):
    """The model's own tokenizer, as jump-forward needs it."""

    @abstractmethod
    def retokenize(self, tokens: list[int]) -> list[int] | None:
        """The canonical tokens of the bytes `tokens` decode to, or None when those bytes are not whole
        UTF-8 characters or any of `tokens` is a special token (nothing to retokenize then)."""

    def retokenize_all(self, seqs: list[list[int]]) -> list[list[int] | None]:
        """`retokenize` of each (backends batch it where their tokenizer can)."""
        return [self.retokenize(s) for s in seqs]


class GrammarBackend(Retokenizer):
    """A grammar library on the model's tokenizer: compiles grammars (GrammarError when one cannot be
    used) and retokenizes (llguidance_backend.py, xgrammar_backend.py). A compile is two halves:
    `prepare`, every check and a trial of the library's compile, which may run in another process with
    a backend built alike (it returns something that pickles), and `load`, in the process that decodes:
    at most the work that the trial finished (the compiled grammars do not cross processes cheaply)."""

    @abstractmethod
    def prepare(self, spec: GrammarSpec) -> object:
        """Every check, and the library's compile; GrammarError when the grammar cannot be used."""

    @abstractmethod
    def load(self, prepared: object) -> CompiledGrammar:
        """The compiled grammar from what `prepare` returned (here or in another process)."""

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Both halves here (no timeout can stop them: admission.py runs `prepare` in a worker)."""
        return self.load(self.prepare(spec))

    @abstractmethod
    def decode_bytes(self, tokens: list[int]) -> bytes:
        """The bytes the tokens stand for (a special token's: its text)."""

    @abstractmethod
    def vocab_bytes(self) -> list[bytes | None]:
        """Each token id's bytes, for the ids of the grammar's vocabulary (None: never a token)."""


_PROBE = ' Hello, world! 12 {"a": [3.5]}\n\tnaïve 日本'


def tokenizer_text(path: str) -> str:
    """tokenizer.json's text as the grammar libraries should read it: a byte-level BPE's decoder is
    plain ByteLevel. Some transformers versions (5.17) save the default model's GGUF-converted
    tokenizer with a decoder Sequence (ByteFallback, Fuse, Replace "\u2581", ByteLevel); a library
    then does not see a byte-level vocabulary (llguidance did not) and reads "\u0120" as the bytes
    C4 A0 instead of a space, which makes every mask and forced token wrong. On a byte-level
    vocabulary the other decoders change nothing."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    data = json.loads(text)
    decoder = data.get("decoder") or {}
    parts = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else []
    byte_level = [d for d in parts if d.get("type") == "ByteLevel"]
    if not byte_level:
        return text
    data["decoder"] = byte_level[0]
    return json.dumps(data)


def check_round_trip(round_trip: Callable[[str], bytes], path: str) -> None:
    """ValueError unless a probe text survives a backend's tokenize + decode (round_trip: text -> the
    bytes of its tokens): masks from a misread vocabulary would be silently wrong."""
    if round_trip(_PROBE) != _PROBE.encode():
        raise ValueError(f"the grammar backend misreads the vocabulary of {path} (text does not survive "
                         "tokenize + decode)")  # fmt: skip


class GrammarCache:
    """Compiled grammars by (kind, text), compiled on a small thread pool off the step loop; the
    `capacity` most recently used are kept (a request holds its own matcher, not the cache entry)."""

    def __init__(self, compile_fn: Callable[[GrammarSpec], CompiledGrammar], workers: int = 2,
                 capacity: int = 512) -> None:  # fmt: skip
        self._compile = compile_fn
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._futures: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self.capacity = capacity
        self._lock = threading.Lock()

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compile of `spec`, started now or earlier (a failure is kept: the same text fails again)."""
        if spec.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}; allowed: {', '.join(KINDS)}")
        with self._lock:
            fut = self._futures.get(spec)
            if fut is None:
                fut = self._futures[spec] = self._pool.submit(self._compile, spec)
                while len(self._futures) > self.capacity:
                    self._futures.popitem(last=False)
            else:
                self._futures.move_to_end(spec)
            return fut

    def run(self, fn: Callable[[], object]) -> Future:
        """fn on the compile threads (other work a grammar needs before its request can start)."""
        return self._pool.submit(fn)

    def get(self, spec: GrammarSpec, timeout_s: float) -> CompiledGrammar:
        fut = self.submit(spec)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"compiling the {spec.kind} took longer than {timeout_s:g} s; simplify it"
            ) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
