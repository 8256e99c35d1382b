"""A grammar that waits for the end of the reasoning (SGLang's structured outputs for reasoning models).

A reasoning model writes `<think> ... </think>` before its answer; a grammar (a JSON schema, a forced
tool call) must shape the answer, not the reasoning. With `require_reasoning` (the gateway sets it on
a chat request with a grammar when the server's `--reasoning-parser` names a model that reasons by
default) the request's matcher is a `ReasoningGate` around the grammar's own: until the output's bytes
hold the end tag, every token is allowed, nothing is forced and the grammar takes nothing; from the
token after the one that completes the tag, the grammar applies as it would from the output's start.

The tag is matched on the tokens' bytes, not on token ids, so it is found however the model spells it
in tokens. Bytes a token carries past the tag (`>{` when `>` and `{` merge) are in the answer but not
seen by the grammar, which starts after that token. The grammar's rollback (jump-forward's
retokenization) never reaches back into the reasoning: `undoable` bounds it to what the grammar took.
A model that never writes the tag is never constrained, as in SGLang.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.scheduler.constrained.grammar import Matcher


class ReasoningGate(Matcher):
    def __init__(self, inner: Matcher, end_tag: str, token_bytes: Callable[[list[int]], bytes]) -> None:
        if not end_tag:
            raise ValueError("a reasoning gate needs the end tag")
        self.inner = inner
        self._end = end_tag.encode()
        self._bytes = token_bytes
        self._tail = b""  # thinking: the last len(end) - 1 bytes of the output
        self._after: int | None = None  # tokens the grammar took since the tag (None: still thinking)
        self._error = ""

    @property
    def thinking(self) -> bool:
        return self._after is None

    def grammar_now(self) -> Matcher | None:
        return None if self._after is None else self.inner

    @property
    def undoable(self) -> int:
        return self._after or 0

    @property
    def mask_words(self) -> int:
        return self.inner.mask_words

    def fill_bitmask(self, row: torch.Tensor) -> None:
        if self._after is None:
            row.fill_(-1)
        else:
            self.inner.fill_bitmask(row)

    def accept(self, tokens: list[int]) -> bool:
        if self._after is not None:
            ok = self.inner.accept(tokens)
            self._after += len(tokens) if ok else 0
            return ok
        tail, end = self._tail, self._end
        for i, t in enumerate(tokens):
            window = tail + self._bytes([t])
            if end in window:
                rest = tokens[i + 1 :]
                if rest and not self.inner.accept(rest):  # all or nothing: still thinking, as before
                    self._error = self.inner.error
                    return False
                self._after, self._tail = len(rest), b""
                return True
            tail = window[len(window) - len(end) + 1 :] if len(end) > 1 else b""
        self._tail = tail
        return True

    def taken(self, n: int) -> None:
        assert self._after is not None, "the grammar takes tokens only after the reasoning"
        self._after += n

    def rollback(self, n: int) -> None:
        if n > self.undoable:
            raise ValueError(
                f"cannot roll back {n} tokens: the grammar took {self.undoable} since the reasoning"
            )
        if n:
            self.inner.rollback(n)
            self._after -= n  # type: ignore[operator]

    def forced(self) -> list[int]:
        return [] if self._after is None else self.inner.forced()

    @property
    def done(self) -> bool:
        return self._after is not None and self.inner.done

    @property
    def error(self) -> str:
        return self._error or self.inner.error

    @property
    def error_status(self) -> int:
        return self.inner.error_status
