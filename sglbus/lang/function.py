"""`@sgl.function`: a Python function over a state, run by the interpreter.

`qa.run(question=...)` gives one ProgramState; `qa.run_batch([{"question": q} for q in qs])` gives
many, run on threads after the prefix they all share went to the runtime's cache.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sglbus.lang.backends.base import Backend, resolve_backend
from sglbus.lang.global_config import global_config
from sglbus.lang.interpreter import StopTracing, StreamExecutor
from sglbus.lang.params import SamplingParams, run_defaults
from sglbus.lang.state import ProgramState
from sglbus.lang.tracer import tracing, tracing_scope

if TYPE_CHECKING:
    from sglbus.lang.compiler import CompiledFunction
    from sglbus.lang.tracer import Trace

log = logging.getLogger(__name__)

# a shorter common prefix is not worth a request of its own before a batch
MIN_PREFIX_CHARS = 64


class Function:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:  # fmt: skip
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"@sgl.function {func.__name__}: the first parameter must be the state (`s`)")
        if num_api_spec_tokens is not None and (
            isinstance(num_api_spec_tokens, bool) or not isinstance(num_api_spec_tokens, int)
            or num_api_spec_tokens < 1
        ):  # fmt: skip
            raise ValueError(f"@sgl.function: num_api_spec_tokens must be an integer >= 1 or None, "
                             f"got {num_api_spec_tokens!r}")  # fmt: skip
        self.func, self.num_api_spec_tokens = func, num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = [p.name for p in params[1:]]
        self.__name__, self.__doc__ = func.__name__, func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        """The same program with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(
                f"{self.__name__}.bind: no parameter {unknown[0]!r}; parameters: {self.arg_names}"
            )
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """run(); inside a program being traced (compile, trace, run_batch's prefix), part of its trace."""
        scope = tracing_scope()
        if scope is not None:
            return scope.call(self, args, kwargs)
        return self.run(*args, **kwargs)

    def run(self, *args: Any, max_new_tokens: int = 128, n: int = 1, stop: str | list[str] | None = None,
            stop_token_ids: list[int] | None = None, stop_regex: str | list[str] | None = None,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
            stream: bool = False, backend: Any = None, use_thread: bool = True,
            **kwargs: Any) -> ProgramState:  # fmt: skip
        """Run the program once. The sampling arguments are the defaults of every `gen` in it; the
        other keyword arguments go to the program. With stream=True it returns at once and
        `text_iter()` follows the text as it is generated."""
        defaults = run_defaults(
            max_new_tokens=max_new_tokens, n=n, stop=stop or [], stop_token_ids=stop_token_ids or [],
            stop_regex=stop_regex or [], temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        )  # fmt: skip
        if stream and self.num_api_spec_tokens is not None:  # SGLang: an error of the program, not of run()
            warnings.warn(f"{self.__name__}.run(stream=True) with num_api_spec_tokens: its first gen fails "
                          f"(state.error()); run without stream=True", stacklevel=2)  # fmt: skip
        return self._run(self._backend(backend), args, kwargs, defaults, stream, use_thread)

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple[Any, ...]], *,
                  max_new_tokens: int = 128, n: int = 1, stop: str | list[str] | None = None,
                  stop_token_ids: list[int] | None = None, stop_regex: str | list[str] | None = None,
                  temperature: float = 1.0, top_p: float = 1.0,
                  top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool | None = None,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  generator_style: bool = False) -> list[ProgramState] | Iterator[ProgramState]:  # fmt: skip
        """Run the program once per argument set, on threads, after caching the prefix every run
        shares. Returns the states in input order (a generator of them with generator_style)."""
        defaults = run_defaults(
            max_new_tokens=max_new_tokens, n=n, stop=stop or [], stop_token_ids=stop_token_ids or [],
            stop_regex=stop_regex or [], temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        )  # fmt: skip
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(
                f"run_batch: batch_kwargs must be a list of dicts, got {type(batch_kwargs).__name__}"
            )
        batch = [self._as_kwargs(i, a) for i, a in enumerate(batch_kwargs)]
        threads = _thread_count(num_threads, len(batch))
        be = self._backend(backend)
        if len(batch) > 1 and global_config.enable_precache_with_tracing:
            self.cache(be)

        def one(kwargs: dict[str, Any]) -> ProgramState:
            state = self._run(be, (), kwargs, defaults, stream=False, use_thread=True)
            state.sync()
            return state

        states = _map(one, batch, threads, progress_bar)
        return states if generator_style else list(states)

    def trace(self, *, backend: Any = None, **arguments: Any) -> Trace:
        """The program as an IR graph (compiler mode), printable; arguments not given are placeholders.
        backend is taken as SGLang's is; the graph does not depend on it (roles and their chat template
        are rendered when the graph runs)."""
        from sglbus.lang.tracer import trace_function

        return trace_function(self, arguments)

    def compile(self, *, backend: Any = None, **bind: Any) -> CompiledFunction:
        """The program traced once into a graph whose runs batch their model calls (compiler mode).
        Raises UntraceableError when its Python code depends on generated values."""
        from sglbus.lang.compiler import CompiledFunction

        return CompiledFunction(self, bind, backend)

    def cache(self, backend: Any = None) -> str:
        """Send the prefix every run of this program starts with to the runtime's prefix cache
        (when longer than 64 characters); returns it."""
        be = self._backend(backend)
        prefix = self.shared_prefix(be)
        if len(prefix) > MIN_PREFIX_CHARS:
            be.cache_prefix(prefix)
        return prefix

    def shared_prefix(self, backend: Backend) -> str:
        """The text the program writes before its first use of an argument or a model call: run it
        with placeholder arguments that stop the trace when touched."""
        executor = StreamExecutor(backend, SamplingParams(), threaded=False, tracing=True)
        state = ProgramState(executor)
        arguments = {name: _Placeholder(name) for name in self.arg_names}
        arguments.update(self.bind_arguments)
        try:
            with tracing(_PrefixScope()):
                self.func(state, **arguments)
        except Exception:  # StopTracing, or what a placeholder does to the program's own code
            pass
        return executor.text_

    # -- plumbing -------------------------------------------------------------------------------
    def _backend(self, backend: Any) -> Backend:
        return resolve_backend(backend)

    def _spec_tokens(self, backend: Backend) -> int | None:
        """num_api_spec_tokens, or None where the backend does not speculate (the setting is ignored)."""
        if self.num_api_spec_tokens is not None and not backend.supports_api_speculative_execution:
            log.debug("%s: num_api_spec_tokens ignored: %s has no API speculative execution",
                      self.__name__, type(backend).__name__)  # fmt: skip
            return None
        return self.num_api_spec_tokens

    def _as_kwargs(self, i: int, arguments: Any) -> dict[str, Any]:
        if isinstance(arguments, dict):
            return arguments
        if isinstance(arguments, (list, tuple)) and len(arguments) <= len(self.arg_names):
            return dict(zip(self.arg_names, arguments, strict=False))
        raise TypeError(f"run_batch: item {i} must be a dict of arguments or a tuple of at most "
                        f"{len(self.arg_names)} values for {self.arg_names}, got {arguments!r}")  # fmt: skip

    def _run(self, backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any], defaults: SamplingParams,
             stream: bool, use_thread: bool) -> ProgramState:  # fmt: skip
        state = ProgramState(StreamExecutor(backend, defaults, stream, threaded=use_thread or stream,
                                            num_api_spec_tokens=self._spec_tokens(backend)))  # fmt: skip
        kwargs = {**kwargs, **self.bind_arguments}

        def body() -> None:
            try:
                state.ret_value = self.func(state, *args, **kwargs)
            finally:
                state.stream_executor.end()
            if global_config.verbosity >= 2:
                print(state.text())

        if stream:
            threading.Thread(target=body, name=f"sglbus-program-{self.__name__}", daemon=True).start()
        else:
            body()
        return state


def _thread_count(num_threads: int | str, jobs: int) -> int:
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"run_batch: num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
    return max(1, min(num_threads, jobs))


def _map(
    fn: Callable[[Any], ProgramState], items: list[Any], threads: int, progress_bar: bool
) -> Iterator[ProgramState]:
    """fn over items on a thread pool, results in input order, with an optional tqdm bar."""
    bar = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(items))
    try:
        with ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(fn, item) for item in items]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _: bar.update())
            for f in futures:
                yield f.result()
    finally:
        if bar is not None:
            bar.close()


class _PrefixScope:
    """shared_prefix's tracing: a program called inside ends the prefix, like any other unknown."""

    def call(self, function: Function, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise StopTracing(function.__name__)


class _Placeholder:
    """An argument while tracing the shared prefix: any use of it ends the trace."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _stop(self, *_: Any) -> Any:
        raise StopTracing(self._name)

    __str__ = __repr__ = __format__ = __add__ = __radd__ = __mul__ = __getitem__ = __iter__ = _stop
    __len__ = __bool__ = __eq__ = __int__ = __float__ = __contains__ = _stop
    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        raise StopTracing(self._name)
