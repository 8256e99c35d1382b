"""ProgramState: what a program function gets as `s`, and what `run` returns.

    s += "Q: " + question + "\\nA:" + sgl.gen("answer", stop="\\n")
    s["answer"], s.text(), s.messages(), s.get_meta_info("answer")

Reading blocks until the executor has produced what is read; appending never blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sglbus.lang import ir
from sglbus.lang.branches import check_join_mode, per_branch
from sglbus.lang.interpreter import StreamExecutor
from sglbus.lang.roles import StateRoles

_END = object()


class ProgramState(StateRoles):
    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None  # what the program function returned

    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        if isinstance(other, ir.AppendedExprList) and other.appended_to(self):
            return self  # `s += s.user(x)`: s.user(x) appended it already
        self.stream_executor.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    get_var = __getitem__
    set_var = __setitem__

    def get_meta_info(self, name: str) -> Any:
        """The runtime's meta_info of the call that produced `name` (tokens, finish reason, logprobs;
        for `select`, the scores of every choice)."""
        return self.stream_executor.get_meta_info(name)

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        """The roles so far, in the OpenAI chat format."""
        self.stream_executor.sync()
        return list(self.stream_executor.messages_)

    def error(self) -> BaseException | None:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def sync(self) -> None:
        self.stream_executor.sync()

    # -- branches -----------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ForkGroup:
        """`size` branches that start from this state's text and run concurrently."""
        if position_ids_offset is not None:
            raise ValueError("fork: position_ids_offset is not supported (the runtime has no such offset)")
        return ForkGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator[ProgramState]:
        """One branch, joined back at the end of the `with` block."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # -- streaming ----------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or one variable) piece by piece as it is generated (`run(stream=True)`); without
        streaming, the whole of it once it is done."""
        if self.stream_executor.stream:
            yield from self.stream_executor.iter_text(var_name)
        else:
            yield self.text() if var_name is None else self[var_name]

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """text_iter for asyncio code: the waiting happens in a thread, not on the event loop."""
        loop = asyncio.get_running_loop()
        pieces = self.text_iter(var_name)
        while (piece := await loop.run_in_executor(None, next, pieces, _END)) is not _END:
            if return_meta_data and var_name is not None:
                yield piece, self.stream_executor.meta_info.get(var_name)
            else:
                yield piece

    def __del__(self) -> None:
        executor = getattr(self, "stream_executor", None)
        if executor is not None:
            executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()})"  # SGLang's format: programs slice the text out of it


class ForkGroup:
    """The branches of `s.fork(n)`: index them, iterate them, append to all of them, join them."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states, self.parent = states, parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:  # `forks[i] += ...` assigns the same state back
            raise TypeError("the branches of a fork cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Callable[[int], Any] | list[Any] | tuple[Any, ...] | Any) -> ForkGroup:
        """A function of the branch index, one item per branch, or the same thing for all."""
        for state, item in zip(self.states, per_branch(other, len(self.states)), strict=True):
            state += item
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable a branch made becomes a list in the parent, one item per
        branch; concate_and_append: the branches' new text is appended to the parent, in order."""
        check_join_mode(mode)
        for state in self.states:
            state.stream_executor.end()
            state.sync()
        if mode == "gather_variable":
            parent = self.parent.stream_executor
            own = set(parent.variables)
            for state in self.states:
                for name, value in state.stream_executor.variables.items():
                    if name not in own:
                        parent.variables.setdefault(name, []).append(value)
        else:
            self.parent += ir.Text(*joined_tail([s.stream_executor for s in self.states]))
            self.parent.sync()


def joined_tail(branches: list[StreamExecutor]) -> tuple[str, tuple[str, ...]]:
    """join("concate_and_append"): the branches' new text, in order, with the images its image tokens
    stand for (a branch's own sgl.image)."""
    text = "".join(b.text_[b.fork_start :] for b in branches)
    return text, tuple(im for b in branches for im in b.images_[b.fork_images :])
