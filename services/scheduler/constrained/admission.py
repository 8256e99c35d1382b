"""Grammars at admission: a request with a grammar waits (the others go ahead) until its grammar has
compiled on the cache's threads, then gets its own matcher. A grammar that fails, or that compiles
for longer than `grammar_compile_timeout` after the request arrived, raises GrammarError: the
scheduler ends that request alone with a 400."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from services.scheduler.constrained.grammar import GrammarCache, GrammarError, Retokenizer

if TYPE_CHECKING:
    from services.scheduler.constrained.llguidance_backend import LLGuidanceBackend
    from services.scheduler.model_runner import ModelRunner
    from services.scheduler.request import Req
    from shared.config import SchedulerConfig


class GrammarAdmission:
    def __init__(self, config: SchedulerConfig, runner: ModelRunner) -> None:
        self.timeout_s = config.grammar_compile_timeout
        self._tokenizer_folder = config.tokenizer_path or runner.model_folder
        self._model = runner.model_config
        self._cache: GrammarCache | None = None  # built at the first request with a grammar
        self._backend: LLGuidanceBackend | None = None

    def ready(self, req: Req, now: float) -> bool:
        """Whether req's matcher is there (made now if its grammar just compiled); False while it
        compiles."""
        assert req.grammar is not None
        if req.matcher is not None:
            return True
        fut = self._grammars().submit(req.grammar)
        if not fut.done():
            if now - req.arrival > self.timeout_s:
                raise GrammarError(f"compiling the {req.grammar.kind} took longer than {self.timeout_s:g} s")
            return False
        e = fut.exception()
        if e is not None:
            raise e if isinstance(e, GrammarError) else GrammarError(f"{req.grammar.kind}: {e!r}")
        req.matcher = fut.result().matcher()
        return True

    def shutdown(self) -> None:
        if self._cache is not None:
            self._cache.shutdown()

    @property
    def retokenizer(self) -> Retokenizer:
        self._grammars()
        assert self._backend is not None
        return self._backend

    def _grammars(self) -> GrammarCache:
        if self._cache is None:
            from services.scheduler.constrained.llguidance_backend import LLGuidanceBackend

            mc = self._model
            self._backend = LLGuidanceBackend(
                os.path.join(self._tokenizer_folder, "tokenizer.json"), mc.vocab_size, mc.eos_token_ids
            )
            self._cache = GrammarCache(self._backend.compile)
        return self._cache
