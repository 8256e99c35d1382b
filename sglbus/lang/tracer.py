"""Tracing for compiler mode: a program called once on a `TraceState`, which records each `s += ...`
as a node of its stream instead of running it, gives its graph (`Trace`). Nodes: constant text
(adjacent strings merged into one segment), argument placeholders, gen, select, roles, var scopes,
image, fork (new streams), join, and the value of another stream's variable. A node depends on the node
before it in its stream; a branch's first node on its fork; a join on the last node of every branch; a
variable's value on the node producing it. Python code that looks at a generated value or a placeholder
(`if s["x"] == ...`, an f-string, a loop) has no static graph: tracing raises UntraceableError, and
interpreter mode still runs it. Another @sgl.function called inside the traced one (`sub(x=s["a"])`) is
traced into the same graph as a stream of its own, which starts empty, as its own run would.
`compiler.py` runs the graph."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from sglbus.lang import ir
from sglbus.lang.branches import check_join_mode, per_branch
from sglbus.lang.roles import StateRoles

if TYPE_CHECKING:
    from sglbus.lang.function import Function

_INTERPRETER = "interpreter mode (fn.run) runs any program"


class UntraceableError(RuntimeError, TypeError):
    """The program has no static graph: its Python code depends on values known only at run time. A
    TypeError too, as SGLang's tracer raises for an argument in an f-string."""


# -- values known only when the graph runs ---------------------------------------------------------
def _refusal(use: str) -> Callable[..., NoReturn]:
    def refuse(self: _Deferred, *_: Any) -> NoReturn:
        raise UntraceableError(f"{self.what()} is used by the program's Python code ({use}) while tracing; "
                               f"{self.hint()}")  # fmt: skip

    return refuse


class _Deferred(ir.Expr):
    """A placeholder or a generated value while tracing: it can be appended to a state, nothing else,
    because any other use would make the program's Python code depend on it."""

    def what(self) -> str:
        raise NotImplementedError

    def hint(self) -> str:
        return _INTERPRETER

    __bool__ = _refusal("as a condition")
    __eq__ = _refusal("compared with ==")
    __ne__ = _refusal("compared with !=")
    __lt__ = __le__ = __gt__ = __ge__ = _refusal("compared")
    __str__ = __format__ = _refusal("str() or an f-string")
    __len__ = _refusal("len()")
    __iter__ = _refusal("iterated")
    __getitem__ = _refusal("indexed")
    __contains__ = _refusal("`in`")
    __int__ = __float__ = __index__ = _refusal("as a number")
    __mul__ = __rmul__ = _refusal("multiplied")
    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and inspect probe for these
            raise AttributeError(name)
        _refusal(f".{name}")(self)


class Argument(_Deferred):
    """A program argument not bound at compile time: its text is given to run()."""

    def __init__(self, name: str) -> None:
        self.name = name

    def what(self) -> str:
        return f"argument {self.name!r}"

    def hint(self) -> str:
        n = self.name
        return (f'a placeholder can only be appended (`s += "Q: " + {n}`); bind it with fn.compile({n}=...), '
                f"or {_INTERPRETER}")  # fmt: skip

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"


class VarRef(_Deferred):
    """`s["x"]` while tracing: the value the node `node` will produce."""

    def __init__(self, name: str | None, node: Node) -> None:
        self.name, self.node = name, node

    def what(self) -> str:
        return f"the generated value of {self.name!r}"

    def hint(self) -> str:
        return f"control flow on what the model generates has no static graph; {_INTERPRETER}"

    def __repr__(self) -> str:
        return f"VarRef({self.name!r} of %{self.node.id})"


# -- the graph ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class Fork:
    size: int
    branches: list[int] = field(default_factory=list)  # the branches' streams


@dataclass(eq=False)
class Join:
    mode: str
    branches: list[int]


@dataclass(eq=False)
class SetVar:
    name: str
    value: Any


_KINDS = {ir.Text: "text", Argument: "argument", ir.Gen: "gen", ir.Select: "select",
          ir.RoleBegin: "role_begin", ir.RoleEnd: "role_end", ir.VarScopeBegin: "var_scope_begin",
          ir.VarScopeEnd: "var_scope_end", ir.Image: "image", ir.Video: "video", Fork: "fork", Join: "join",
          VarRef: "variable", SetVar: "set_var", ir.SeparateReasoning: "separate_reasoning"}  # fmt: skip


@dataclass(eq=False)
class Node:
    id: int
    stream: int  # 0: the program's own state; forks make more
    step: Any  # an ir step (Text, Gen, Select, roles, scopes, Image), Argument, VarRef, Fork, Join or SetVar
    deps: list[Node]
    produces: list[str | None] = field(default_factory=list)  # the variables it sets

    @property
    def kind(self) -> str:
        return _KINDS[type(self.step)]

    @property
    def is_model_call(self) -> bool:
        return isinstance(self.step, (ir.Gen, ir.Select))

    def __str__(self) -> str:
        s = self.step
        if isinstance(s, ir.Text):
            what = repr(s.value if len(s.value) <= 48 else s.value[:45] + "...")
        elif isinstance(s, ir.Gen):
            what = f"{s.name} " + ", ".join(f"{k}={v!r}" for k, v in vars(s.params).items() if v is not None)
        elif isinstance(s, ir.Select):
            what = f"{s.name} {s.choices!r}"
        elif isinstance(s, Fork):
            what = f"{s.size} -> " + ", ".join(f"s{b}" for b in s.branches)
        elif isinstance(s, Join):
            what = f"{s.mode} of " + ", ".join(f"s{b}" for b in s.branches)
        elif isinstance(s, VarRef):
            what = f"{s.name!r} of %{s.node.id}"
        else:
            what = getattr(s, "name", None) or getattr(s, "role", None) or ""
        deps = " <- " + ", ".join(f"%{d.id}" for d in self.deps) if self.deps else ""
        return f"%{self.id:<3} s{self.stream:<2} {self.kind:<15} {what}{deps}"

    def print_graph_dfs(self) -> str:
        """This node and every node it depends on, dependencies first, one a line (SGLang's name; it
        returns the text rather than printing it, as SGLang's does)."""
        seen: set[int] = set()
        lines: list[str] = []
        stack: list[tuple[Node, bool]] = [(self, False)]  # iterative: a long program is a long chain
        while stack:
            node, deps_done = stack.pop()
            if deps_done:
                lines.append(str(node) + "\n")
            elif node.id not in seen:
                seen.add(node.id)
                stack.append((node, True))
                stack.extend((d, False) for d in reversed(node.deps))
        return "".join(lines)


class Trace:
    """A traced program: its nodes in creation order (a topological order) and its streams, each a chain
    of nodes. `print(trace)` lists them."""

    def __init__(self, name: str, placeholders: list[str]) -> None:
        self.name, self.placeholders = name, placeholders
        self.nodes: list[Node] = []
        self.streams: dict[int, list[Node]] = {0: []}
        self.stream_start: dict[int, Node | None] = {0: None}  # the fork a branch starts from
        self.ret_value: Any = None  # what the function returned while traced (VarRefs resolved at run)

    @property
    def last_node(self) -> Node | None:
        """The program's last node (of its own stream), as SGLang's tracer has it."""
        return self.last(0)

    def last(self, stream: int) -> Node | None:
        chain = self.streams[stream]
        return chain[-1] if chain else self.stream_start[stream]

    def add(self, stream: int, step: Any, extra_deps: Sequence[Node] = (),
            produces: Sequence[str | None] = ()) -> Node:  # fmt: skip
        chain = self.streams[stream]
        if isinstance(step, ir.Text) and chain and isinstance(chain[-1].step, ir.Text):
            chain[-1].step = ir.Text(chain[-1].step.value + step.value)  # one constant segment
            return chain[-1]
        deps: list[Node] = []
        for d in [self.last(stream), *extra_deps]:
            if d is not None and d not in deps:
                deps.append(d)
        node = Node(len(self.nodes), stream, step, deps, list(produces))
        self.nodes.append(node)
        chain.append(node)
        return node

    def new_stream(self, fork: Node | None) -> int:
        """A branch of fork; without one, the stream of another program called inside this one."""
        stream = len(self.streams)
        self.streams[stream], self.stream_start[stream] = [], fork
        return stream

    def model_calls(self) -> list[Node]:
        return [n for n in self.nodes if n.is_model_call]

    def __str__(self) -> str:
        head = (
            f"trace of {self.name}: {len(self.nodes)} nodes, {len(self.streams)} streams, "
            f"{len(self.model_calls())} model calls; placeholders: {', '.join(self.placeholders) or 'none'}"
        )
        return "\n".join([head, *(f"  {n}" for n in self.nodes)])

    __repr__ = __str__


# -- tracing -----------------------------------------------------------------------------------------
class TraceState(StateRoles):
    """What the program gets as `s` while traced: ProgramState's interface, recording nodes."""

    def __init__(self, trace: Trace, stream: int, variables: dict[str | None, Node]) -> None:
        self.trace, self.stream, self.variables = trace, stream, variables
        self.joined = False
        self.ret_value: Any = None  # of a program called inside the traced one

    def __iadd__(self, other: Any) -> TraceState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        if self.joined:
            raise ValueError("a fork branch is appended to after its join()")
        if isinstance(other, ir.AppendedExprList) and other.appended_to(self):
            return self  # `s += s.user(x)`: s.user(x) appended it already
        for step in ir.leaves(other):
            extra = [step.node] if isinstance(step, VarRef) else []
            produces = ir.produced_names(step)
            node = self.trace.add(self.stream, step, extra, produces)
            for n in produces:
                self.variables[n] = node
        return self

    def __getitem__(self, name: str) -> Any:
        if name not in self.variables:
            known = ", ".join(repr(k) for k in self.variables if k is not None) or "none"
            raise KeyError(f"no variable {name!r} in this state (variables: {known})")
        node = self.variables[name]
        if isinstance(node.step, SetVar) and not _has_deferred(node.step.value):
            return node.step.value  # set by the program itself: known while tracing
        return VarRef(name, node)

    def __setitem__(self, name: str, value: Any) -> None:
        refs = _deferred_nodes(value)
        self.variables[name] = self.trace.add(self.stream, SetVar(name, value), refs, [name])

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    get_var = __getitem__
    set_var = __setitem__

    def _unknown(self, what: str) -> NoReturn:
        raise UntraceableError(f"s.{what} reads what the model generates while tracing; {_INTERPRETER}")

    def text(self) -> str:
        self._unknown("text()")

    def messages(self) -> list[dict[str, Any]]:
        self._unknown("messages()")

    def get_meta_info(self, name: str) -> Any:
        self._unknown(f"get_meta_info({name!r})")

    def error(self) -> NoReturn:
        self._unknown("error()")

    def sync(self) -> None:
        """Nothing runs while tracing: nothing to wait for."""

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> TraceForkGroup:
        if position_ids_offset is not None:
            raise ValueError("fork: position_ids_offset is not supported (the runtime has no such offset)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"fork: size must be an integer >= 1, got {size!r}")
        node = self.trace.add(self.stream, Fork(size))
        node.step.branches = [self.trace.new_stream(node) for _ in range(size)]
        return TraceForkGroup(
            [TraceState(self.trace, b, dict(self.variables)) for b in node.step.branches], self
        )

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator[TraceState]:
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()


class TraceForkGroup:
    """ForkGroup while tracing: the same interface; join() becomes a node of the parent's stream."""

    def __init__(self, states: list[TraceState], parent: TraceState) -> None:
        self.states, self.parent = states, parent

    def __getitem__(self, i: int) -> TraceState:
        return self.states[i]

    def __setitem__(self, i: int, value: TraceState) -> None:
        if value is not self.states[i]:
            raise TypeError("the branches of a fork cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[TraceState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> TraceForkGroup:
        for state, item in zip(self.states, per_branch(other, len(self.states)), strict=True):
            state += item
        return self

    def join(self, mode: str = "gather_variable") -> None:
        check_join_mode(mode)
        parent, trace = self.parent, self.parent.trace
        ends = [trace.last(s.stream) for s in self.states]
        gathered: list[str | None] = []
        if mode == "gather_variable":  # as ForkGroup.join: what the parent did not have becomes a list
            own = set(parent.variables)
            for s in self.states:
                gathered += [n for n in s.variables if n not in own and n not in gathered]
        node = trace.add(parent.stream, Join(mode, [s.stream for s in self.states]),
                         [e for e in ends if e is not None], gathered)  # fmt: skip
        for name in gathered:
            parent.variables[name] = node
        for s in self.states:
            s.joined = True


# -- programs called inside a traced program --------------------------------------------------------
_scopes = threading.local()


def tracing_scope() -> Any:
    """What the program running on this thread is being traced for (its `call(function, args, kwargs)`
    takes the programs it calls), or None when it runs."""
    stack = getattr(_scopes, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def tracing(scope: Any) -> Iterator[None]:
    stack = _scopes.__dict__.setdefault("stack", [])
    stack.append(scope)
    try:
        yield
    finally:
        stack.pop()


class GraphScope:
    """A program traced into a graph: a program it calls is traced into the same graph, as a stream of
    its own that starts empty (as its own run would) and depends on the values it is given."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def call(self, function: Function, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TraceState:
        name = function.__name__
        if function.num_api_spec_tokens is not None:
            raise UntraceableError(f"{name} has num_api_spec_tokens: API speculative execution is for "
                                   f"interpreter mode; {_INTERPRETER}")  # fmt: skip
        extra = [k for k in kwargs if k not in function.arg_names]
        if extra:
            raise UntraceableError(
                f"{name}({extra[0]}=...): a program called inside a traced one takes its own arguments only "
                f"(its sampling defaults and backend are those of the compiled run); parameters: "
                f"{function.arg_names}"
            )
        if len(args) > len(function.arg_names):
            raise TypeError(f"{name}: {len(args)} positional arguments for parameters {function.arg_names}")
        values = {**dict(zip(function.arg_names, args, strict=False)), **kwargs, **function.bind_arguments}
        state = TraceState(self.trace, self.trace.new_stream(None), {})
        state.ret_value = function.func(state, **values)
        return state


def trace_function(function: Function, arguments: dict[str, Any]) -> Trace:
    """function's graph, with `arguments` (and what function.bind fixed) as constants and the other
    arguments as placeholders."""
    unknown = [k for k in arguments if k not in function.arg_names]
    if unknown:
        raise TypeError(f"{function.__name__}: no parameter {unknown[0]!r}; parameters: {function.arg_names}")
    values: dict[str, Any] = {name: Argument(name) for name in function.arg_names}
    values.update({**function.bind_arguments, **arguments})
    trace = Trace(function.__name__, [k for k, v in values.items() if isinstance(v, Argument)])
    try:
        with tracing(GraphScope(trace)):
            trace.ret_value = function.func(TraceState(trace, 0, {}), **values)
    except UntraceableError as e:
        raise UntraceableError(f"cannot trace {function.__name__}: {e}") from None
    except Exception as e:
        raise UntraceableError(
            f"cannot trace {function.__name__}: the program raised {type(e).__name__}: {e} (a program whose "
            f"Python code works with generated values or placeholders has no static graph; {_INTERPRETER})"
        ) from e
    return trace


def _deferred_nodes(value: Any) -> list[Node]:
    if isinstance(value, VarRef):
        return [value.node]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _deferred_nodes(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _deferred_nodes(v)]
    return []


def _has_deferred(value: Any) -> bool:
    if isinstance(value, _Deferred):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_deferred(v) for v in value)
    return isinstance(value, dict) and any(_has_deferred(v) for v in value.values())
