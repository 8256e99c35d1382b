"""The role and scope methods of a program state (`s.user(...)`, `with s.assistant(): ...`,
`with s.var_scope("x"): ...`), written once for the running state (`state.py`) and the tracing one
(`tracer.py`): both only need `+=`."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sglbus.lang import ir


class StateRoles:
    def _role(self, role: str, expr: Any = None) -> Any:
        """With expr: the role is appended now, and returned (`s += s.user(x)` does not append it twice,
        see ir.AppendedExprList); without: a `with` block."""
        if expr is not None:
            steps = [ir.RoleBegin(role), *ir.leaves(expr), ir.RoleEnd(role)]
            self += ir.ExprList(steps)  # type: ignore[operator]  # the state's own __iadd__
            return ir.AppendedExprList(steps, weakref.ref(self))
        return self._scope(ir.RoleBegin(role), ir.RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def var_scope(self, name: str) -> Any:
        """`with s.var_scope("x"): ...`: s["x"] is the text appended inside."""
        return self._scope(ir.VarScopeBegin(name), ir.VarScopeEnd(name))

    @contextmanager
    def _scope(self, begin: ir.Expr, end: ir.Expr) -> Iterator[None]:
        self += begin  # type: ignore[operator]  # the state's own __iadd__
        yield
        self += end  # type: ignore[operator]
