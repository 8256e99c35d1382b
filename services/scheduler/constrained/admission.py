"""Grammars at admission: a request with a grammar waits (the others go ahead) until its grammar has
compiled on the cache's threads, then gets its own matcher. A grammar that fails, or that compiles
for longer than `grammar_compile_timeout` after the request arrived, raises GrammarError: the
scheduler ends that request alone with a 400.

The compile itself (`GrammarBackend.prepare`) runs in one of two worker processes, each with its own
backend (shared/grammar_sandbox.py): a thread could not be stopped, so a compile past the timeout kept
its thread (two such grammars took both, and every later grammar timed out behind them) and, with
xgrammar, the GIL. Past `grammar_compile_timeout` of its own the worker is killed and replaced, and
a worker that dies fails only its grammar (a 500). The cache's thread then compiles it here, work the
worker finished within the timeout (grammar.py: `prepare`, `load`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from services.scheduler.constrained.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCache,
    GrammarError,
    GrammarSpec,
    Retokenizer,
)
from services.scheduler.constrained.reasoning_gate import ReasoningGate, TagGuard
from shared.grammar_sandbox import GrammarSandbox, GrammarTimeout, WorkerDied
from shared.metrics import GRAMMAR_COMPILE_BUCKETS, BucketCounts

log = logging.getLogger(__name__)
BACKEND_START_S = 120.0  # importing and setting up the grammar library, before any compile's own timeout
COMPILE_WORKERS = 2  # processes, as many as the cache's threads
_worker_backend: GrammarBackend | None = None  # in a compile worker: its backend

if TYPE_CHECKING:
    from services.scheduler.model_runner import ModelRunner
    from services.scheduler.request import Req
    from shared.config import SchedulerConfig


class GrammarAdmission:
    def __init__(self, config: SchedulerConfig, runner: ModelRunner) -> None:
        self.timeout_s = config.grammar_compile_timeout
        self._backend_name = config.grammar_backend
        self._tokenizer_path, self._runner = config.tokenizer_path, runner  # read at the first grammar
        self._cache: GrammarCache | None = None  # built at the first request with a grammar
        self._backend: GrammarBackend | None = None
        self._sandbox: GrammarSandbox | None = None  # the compile workers, started with the backend
        self._backend_lock = threading.Lock()
        self._ready_at: float | None = None  # when the backend was built (the compile clock starts)
        self._broken: str | None = None  # why the backend could not be built
        self._guards: dict[str, Future[TagGuard]] = {}  # end tag -> its masks (reasoning_gate.py)
        # seconds each compile took (cache misses; the backend's start is not counted): /metrics
        self.compile_times = BucketCounts(GRAMMAR_COMPILE_BUCKETS)

    def ready(self, req: Req, now: float) -> bool:
        """Whether req's matcher is there (made now if its grammar just compiled); False while it
        compiles. GrammarError when the request cannot have one; never another exception (the step
        must not fail for one request's grammar). The compile timeout counts from the request's
        arrival or from when the backend was built, whichever is later: the first grammar also waits
        for the library's import (seconds), which is not its grammar's fault."""
        assert req.grammar is not None
        if req.matcher is not None:
            return True
        try:
            fut = self._grammars().submit(req.grammar)
            if not fut.done():
                ready_at = self._ready_at
                if ready_at is None and now - req.arrival > self.timeout_s + BACKEND_START_S:
                    raise GrammarError(f"the grammar backend did not start within {BACKEND_START_S:g} s", 500)
                if ready_at is not None and now - max(req.arrival, ready_at) > self.timeout_s:
                    raise GrammarError(
                        f"compiling the {req.grammar.kind} took longer than {self.timeout_s:g} s; simplify it"
                    )
                return False
            e = fut.exception()
            if e is not None:
                raise e
            compiled = fut.result()
            if not req.reasoning_end:
                req.matcher = compiled.matcher()
                return True
            # and the end tag's masks, built once per tag on the same threads
            backend, tag = self._backend, req.reasoning_end
            assert backend is not None  # it compiled the grammar
            guard = self._guards.get(tag)
            if guard is None:
                guard = self._guards[tag] = self._grammars().run(self._guard_builder(tag, compiled))
            if not guard.done():  # behind compiles on the same threads: the compile timeout holds
                if self._ready_at is not None and now - max(req.arrival, self._ready_at) > self.timeout_s:
                    raise GrammarError(f"preparing the grammar took longer than {self.timeout_s:g} s")
                return False
            if guard.exception() is not None:
                del self._guards[tag]  # the next request tries again
            req.matcher = ReasoningGate(compiled.matcher(), guard.result(), backend.decode_bytes)
            return True
        except GrammarError:
            raise
        except Exception as e:
            log.exception("constrained decoding failed for request %s", req.rid)
            raise GrammarError(f"internal error in constrained decoding: {type(e).__name__}: {e}", 500) from e

    def _guard_builder(self, tag: str, compiled: CompiledGrammar):
        backend, words = self._backend, compiled.matcher().mask_words
        assert backend is not None
        return lambda: TagGuard(tag, backend.vocab_bytes(), words)

    def shutdown(self) -> None:
        if self._cache is not None:
            self._cache.shutdown()
        if self._sandbox is not None:
            self._sandbox.close()

    @property
    def retokenizer(self) -> Retokenizer:
        """The backend (built: a request with a matcher exists)."""
        assert self._backend is not None
        return self._backend

    def _grammars(self) -> GrammarCache:
        if self._broken is not None:  # tried once: every grammar request fails alike, at once
            raise GrammarError(self._broken, 500)
        if self._cache is None:
            self._cache = GrammarCache(self._compile)
        return self._cache

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """On the cache's threads (importing the library takes seconds; the step loop must not wait):
        checked and tried in a compile worker, then compiled here."""
        backend = self.backend()
        assert self._sandbox is not None  # started with the backend
        t0 = time.perf_counter()
        try:
            return backend.load(self._sandbox.run(self.timeout_s, _prepare, spec))
        except GrammarTimeout:
            log.warning("a %s of %d characters took longer than %g s to compile: its worker was killed",
                        spec.kind, len(spec.text), self.timeout_s)  # fmt: skip
            raise GrammarError(
                f"compiling the {spec.kind} took longer than {self.timeout_s:g} s; simplify it"
            ) from None
        except WorkerDied as e:
            log.error(
                "a grammar compile worker died on a %s of %d characters: %s", spec.kind, len(spec.text), e
            )
            raise GrammarError(f"compiling the {spec.kind} failed: {e}", 500) from None
        finally:
            self.compile_times.observe(time.perf_counter() - t0)

    def backend(self) -> GrammarBackend:
        """The backend, built by the first caller; GrammarError (500) when it cannot start."""
        with self._backend_lock:
            if self._backend is None:
                if self._broken is not None:
                    raise GrammarError(self._broken, 500)
                mc = self._runner.model_config
                folder = self._tokenizer_path or self._runner.model_folder
                args = (os.path.join(folder, "tokenizer.json"), mc.vocab_size, mc.eos_token_ids)
                sandbox = GrammarSandbox(COMPILE_WORKERS, _start_worker, (self._backend_name, *args))
                try:
                    sandbox.spawn()  # the workers build theirs meanwhile
                    self._backend = backend_class(self._backend_name)(*args)
                    sandbox.start(BACKEND_START_S)
                    self._sandbox = sandbox
                except Exception as e:
                    sandbox.close()
                    self._backend = None
                    log.exception("the grammar backend cannot start")
                    why = f"{type(e).__name__}: {e}"
                    self._broken = f"constrained decoding is unavailable on this server: {why}"
                    raise GrammarError(self._broken, 500) from e
                self._ready_at = time.monotonic()
            return self._backend


def _start_worker(name: str, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
    """A compile worker's start: its own backend, built as the scheduler's."""
    global _worker_backend
    _worker_backend = backend_class(name)(tokenizer_json, vocab_size, eos_ids)


def _prepare(spec: GrammarSpec) -> object:
    """In a compile worker: the backend's `prepare` (GrammarError travels back as it is)."""
    assert _worker_backend is not None
    return _worker_backend.prepare(spec)


def backend_class(name: str) -> type[GrammarBackend]:
    """The grammar backend class for `--grammar-backend` (auto: xgrammar when it imports)."""
    if name == "auto":
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            name = "llguidance"
        else:
            name = "xgrammar"
    if name == "xgrammar":
        from services.scheduler.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    from services.scheduler.constrained.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend
