"""What a fork group's `+=` and `join` mean, written once for the running (`state.py`) and the tracing
(`tracer.py`) fork groups."""

from __future__ import annotations

from typing import Any

JOIN_MODES = ("gather_variable", "concate_and_append")


def per_branch(other: Any, n: int) -> list[Any]:
    """`forks += other`: a function of the branch index, one item per branch, or the same for all."""
    if isinstance(other, (list, tuple)):
        if len(other) != n:
            raise ValueError(f"{len(other)} items for {n} branches")
        return list(other)
    if callable(other):
        return [other(i) for i in range(n)]
    return [other] * n


def check_join_mode(mode: str) -> None:
    if mode not in JOIN_MODES:
        raise ValueError(f"join: mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
