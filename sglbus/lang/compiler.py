"""Compiler mode: a program traced once into a graph (`tracer.py`), then run by a scheduler that
batches.

    compiled = qa.compile()  # arguments not bound here are placeholders
    print(compiled.trace)  # the graph, one node a line, with what each depends on
    states = compiled.run_batch([{"question": q} for q in questions], temperature=0)

The scheduler runs every instance of the graph (one per argument set) at once. Local nodes (text,
roles, forks, joins) run as soon as their dependencies are done; then the model calls ready in all
streams of all instances go out together: the gens as one `generate_batch` request, the selects side
by side on threads. Each stream is a StreamExecutor driven by the graph, so a step means what it means
in interpreter mode and greedy results are the same.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sglbus.lang import ir
from sglbus.lang.function import _thread_count
from sglbus.lang.interpreter import StreamExecutor
from sglbus.lang.params import RUN_DEFAULTS, SamplingParams, run_defaults
from sglbus.lang.state import ProgramState, joined_tail

if TYPE_CHECKING:
    from sglbus.lang.backends.base import Backend
    from sglbus.lang.function import Function

from sglbus.lang.tracer import Argument, Fork, Join, Node, SetVar, Trace, VarRef, trace_function


# -- running the graph -------------------------------------------------------------------------------
class _Instance:
    """One run of the graph: a StreamExecutor per stream, each node run once its dependencies are done."""

    def __init__(
        self, trace: Trace, backend: Backend, defaults: SamplingParams, arguments: dict[str, Any]
    ) -> None:
        self.trace, self.arguments = trace, arguments
        # the program's own stream and those of the programs it calls start empty; forks make the others
        self.executors = {s: StreamExecutor(backend, defaults, threaded=False)
                          for s, start in trace.stream_start.items() if start is None}  # fmt: skip
        self.pos = dict.fromkeys(trace.streams, 0)  # each stream's next node
        self.done: set[int] = set()
        self.values: dict[tuple[int, str | None], Any] = {}  # (node, variable) -> what it produced

    @property
    def complete(self) -> bool:
        return all(self.pos[s] == len(chain) for s, chain in self.trace.streams.items())

    def advance(self) -> list[Node]:
        """Run the local nodes that can run; return the model calls that are ready (one per stream at
        most: a stream is a chain)."""
        moved, ready = True, []
        while moved:
            moved, ready = False, []
            for stream, chain in self.trace.streams.items():
                while self.pos[stream] < len(chain):
                    node = chain[self.pos[stream]]
                    if not all(d.id in self.done for d in node.deps):
                        break
                    if node.is_model_call and self.executors[stream].error_ is None:
                        ready.append(node)
                        break
                    self._run_local(node)
                    self.finish(node)
                    moved = True
        return ready

    def finish(self, node: Node) -> None:
        self.done.add(node.id)
        self.pos[node.stream] += 1
        ex = self.executors[node.stream]
        for name in node.produces:
            self.values[(node.id, name)] = ex.variables.get(name)

    def resolve(self, value: Any) -> Any:
        """value with its placeholders and generated values filled in."""
        if isinstance(value, Argument):
            return self.arguments[value.name]
        if isinstance(value, VarRef):
            return self.values[(value.node.id, value.name)]
        if isinstance(value, (list, tuple)):
            return type(value)(self.resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        if isinstance(value, (ir.Image, ir.Video)):  # sgl.image(path) with path an argument
            return dataclasses.replace(value, path=self.resolve(value.path))
        return value

    def _run_local(self, node: Node) -> None:
        ex, step = self.executors[node.stream], node.step
        if isinstance(step, Fork):
            for b in step.branches:
                # no prefix-cache hint (StreamExecutor.fork sends one): the branches' calls go out in
                # one batch, and the runtime shares their common prefix within a batch
                self.executors[b] = ex.branch(threaded=False)
        elif isinstance(step, Join):
            _join(ex, [self.executors[b] for b in step.branches], step.mode)
        elif isinstance(step, SetVar):
            ex.set_var(step.name, self.resolve(step.value))
        elif node.is_model_call:
            pass  # the stream failed earlier: skipped, as the interpreter skips what follows a failure
        else:
            try:
                ex.submit(self.resolve(step))
            except TypeError as e:  # another stream's value that is not text (a list, after n > 1)
                ex.error_ = ex.error_ or e

    def apply(self, node: Node, result: Any) -> None:
        """A model call's result (or its exception) into the stream, as the interpreter's _gen / _select."""
        ex, name = self.executors[node.stream], node.step.name
        if isinstance(result, Exception):
            ex.error_ = result
        elif isinstance(node.step, ir.Gen):
            text, meta = result  # n > 1: the variable holds every sample, the text goes on with the first
            ex.text_ += text[0] if isinstance(text, list) else text
            ex.variables[name], ex.meta_info[name] = text, meta
        else:
            ex.text_ += result.decision
            ex.variables[name], ex.meta_info[name] = result.decision, result.meta_info
        self.finish(node)


def _join(parent: StreamExecutor, branches: list[StreamExecutor], mode: str) -> None:
    """ForkGroup.join on executors."""
    if mode == "gather_variable":
        own = set(parent.variables)
        for b in branches:
            for name, value in b.variables.items():
                if name not in own:
                    parent.variables.setdefault(name, []).append(value)
    else:
        parent.submit(ir.Text(*joined_tail(branches)))


def run_graph(instances: list[_Instance], backend: Backend, threads: int,
              on_complete: Callable[[_Instance], None] = lambda _: None) -> None:  # fmt: skip
    """Run every instance to the end. At each point: run what is local, then send the model calls
    ready in every stream of every instance together, and wait for all of them."""
    pending = list(instances)
    with ThreadPoolExecutor(threads, thread_name_prefix="sglbus-compiled") as pool:
        while pending:
            calls = [(inst, node) for inst in pending for node in inst.advance()]
            for inst in [i for i in pending if i.complete]:
                on_complete(inst)
            pending = [i for i in pending if not i.complete]
            if not calls:
                if pending:  # cannot happen: a node only depends on nodes made before it
                    raise RuntimeError(f"compiled {pending[0].trace.name}: the graph stalled")
                return
            _call_model(pool, backend, calls)


def _call_model(pool: ThreadPoolExecutor, backend: Backend, calls: list[tuple[_Instance, Node]]) -> None:
    gens = [(i, n) for i, n in calls if isinstance(n.step, ir.Gen)]
    selects = [(i, n) for i, n in calls if isinstance(n.step, ir.Select)]
    batch = None
    if gens:
        executors = [i.executors[n.stream] for i, n in gens]
        params = [ex.gen_params(n.step) for ex, (_, n) in zip(executors, gens, strict=True)]
        batch = pool.submit(backend.generate_batch, [ex.prompt() for ex in executors], params)
    chosen = [pool.submit(backend.select, i.executors[n.stream].prompt(), n.step.choices, n.step.method)
              for i, n in selects]  # fmt: skip
    if batch is not None:
        try:
            results: list[Any] = batch.result()
        except Exception as e:  # the batch as a whole failed: every gen in it did
            results = [e] * len(gens)
        for (inst, node), result in zip(gens, results, strict=True):
            inst.apply(node, result)
    for (inst, node), future in zip(selects, chosen, strict=True):
        try:
            result = future.result()
        except Exception as e:
            result = e
        inst.apply(node, result)


class CompiledFunction:
    """A program traced once (`fn.compile(**bind)`): `run` and `run_batch` execute its graph and return
    ProgramStates, as interpreter mode does."""

    def __init__(self, function: Function, bind: dict[str, Any], backend: Any = None) -> None:
        if function.num_api_spec_tokens is not None:
            raise ValueError(
                f"{function.__name__}.compile: API speculative execution (num_api_spec_tokens) matches "
                f"gens one stream at a time; run the program in interpreter mode (fn.run)"
            )
        self.function, self.backend = function, backend
        self.trace = trace_function(function, bind)
        params = inspect.signature(function.func).parameters
        self.arg_defaults = {n: params[n].default for n in self.trace.placeholders
                             if params[n].default is not inspect.Parameter.empty}  # fmt: skip
        self._as_text = {n.step.name for n in self.trace.nodes if isinstance(n.step, Argument)}

    def __str__(self) -> str:
        return str(self.trace)

    def print_graph(self) -> None:
        """Print the graph, one node a line in topological order (SGLang's CompiledFunction.print_graph)."""
        print(self.trace)

    def run(self, *args: Any, backend: Any = None, **kwargs: Any) -> ProgramState:
        """One run; keyword arguments are the program's placeholders and run()'s sampling defaults."""
        if "stream" in kwargs and "stream" not in self.trace.placeholders:
            raise TypeError("a compiled program does not stream; fn.run(stream=True) does (interpreter mode)")
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_DEFAULTS}
        if len(args) > len(self.trace.placeholders):
            raise TypeError(f"compiled {self.function.__name__}: {len(args)} positional arguments for the "
                            f"placeholders {self.trace.placeholders}")  # fmt: skip
        arguments = {**dict(zip(self.trace.placeholders, args, strict=False)), **kwargs}
        return self.run_batch([arguments], backend=backend, **sampling)[0]

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple[Any, ...]], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  **sampling: Any) -> list[ProgramState]:  # fmt: skip
        """Every argument set through the graph together: the ready gens of all runs go out as one
        batch request at each point. num_threads bounds the backend calls in flight (selects run one
        call each). Returns the states in input order."""
        unknown = [k for k in sampling if k not in RUN_DEFAULTS]
        if unknown:
            raise TypeError(
                f"run_batch: unknown argument {unknown[0]!r}; sampling defaults: {', '.join(RUN_DEFAULTS)}"
            )
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(
                f"run_batch: batch_kwargs must be a list of dicts, got {type(batch_kwargs).__name__}"
            )
        arguments = [self._arguments(i, a) for i, a in enumerate(batch_kwargs)]
        defaults = run_defaults(**{**RUN_DEFAULTS, **{k: v for k, v in sampling.items() if v is not None}})
        be = self.function._backend(backend if backend is not None else self.backend)
        instances = [_Instance(self.trace, be, defaults, a) for a in arguments]
        threads = _thread_count(num_threads, max(1, len(instances) * len(self.trace.streams)))
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(instances))
        try:
            run_graph(
                instances, be, threads, (lambda _: bar.update()) if bar is not None else (lambda _: None)
            )
        finally:
            if bar is not None:
                bar.close()
        states = []
        for inst in instances:
            for ex in inst.executors.values():
                ex.end()
            state = ProgramState(inst.executors[0])
            state.ret_value = inst.resolve(self.trace.ret_value)
            states.append(state)
        return states

    def _arguments(self, i: int, arguments: Any) -> dict[str, Any]:
        """Run set i as the placeholders' values, checked: bound names, missing ones, non-text."""
        name, places = f"compiled {self.function.__name__}", self.trace.placeholders
        if isinstance(arguments, (list, tuple)) and len(arguments) <= len(places):
            arguments = dict(zip(places, arguments, strict=False))
        if not isinstance(arguments, dict):
            raise TypeError(f"{name}: run set {i} must be a dict of arguments or a tuple of at most "
                            f"{len(places)} values for {places}, got {arguments!r}")  # fmt: skip
        for k in arguments:
            if k not in places:
                why = "was bound when compiling" if k in self.function.arg_names else "is no parameter"
                raise TypeError(f"{name}: {k!r} {why}; placeholders: {places}")
        values = {**self.arg_defaults, **arguments}
        missing = [k for k in places if k not in values]
        if missing:
            raise TypeError(f"{name}: missing argument {missing[0]!r} (run set {i})")
        for k in self._as_text:
            if not isinstance(values[k], str):
                raise TypeError(
                    f"{name}: argument {k!r} must be a string (the graph appends it as text), got "
                    f"{type(values[k]).__name__}; bind other values with compile({k}=...)"
                )
        return values
