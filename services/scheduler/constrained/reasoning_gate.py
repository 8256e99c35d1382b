"""A grammar that waits for the end of the reasoning (SGLang's structured outputs for reasoning models).

A reasoning model writes `<think> ... </think>` before its answer; a grammar (a JSON schema, a forced
tool call) must shape the answer, not the reasoning. With `require_reasoning` (the gateway sets it on
a chat request with a grammar when the server's `--reasoning-parser` names a model that reasons by
default) the request's matcher is a `ReasoningGate` around the grammar's own: until the output's bytes
hold the end tag, nothing is forced and the grammar takes nothing; from the token after the one that
completes the tag, the grammar applies as it would from the output's start.

The tag is matched on the tokens' bytes, not on token ids, so it is found however the model spells it
in tokens (a special token's bytes are its text). While the grammar waits, the mask allows every token
of the vocabulary but those that would complete the tag and carry bytes past it (`>"` after `</think`):
those bytes would reach the answer without the grammar seeing them. `TagGuard` holds one mask row per
state (how many of the tag's first bytes the output ends with), built once per tag and vocabulary on
the grammar pool. The grammar's rollback (jump-forward's retokenization) never reaches back into the
reasoning: `undoable` bounds it to what the grammar took. A model that never writes the tag is never
constrained, as in SGLang.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.scheduler.constrained.grammar import Matcher


class TagGuard:
    """The end tag's masks over one vocabulary: rows[k] allows every token but those that, after an
    output ending with the tag's first k bytes, complete the tag with bytes past it."""

    def __init__(self, end_tag: str, vocab_bytes: list[bytes | None], words: int) -> None:
        """vocab_bytes: each id's bytes, None for an id that is never a token (past the tokenizer)."""
        end = self.end = end_tag.encode()
        if not end:
            raise ValueError("a reasoning gate needs the end tag")
        full = (1 << 32) - 1
        last = end[-1:]
        # only a token holding the tag's last byte can complete it (a scan in C; the rest in Python)
        candidates = [(t, b) for t, b in enumerate(vocab_bytes) if b is not None and last in b]
        base = [full] * words  # every id that is ever a token
        for t in [*(t for t, b in enumerate(vocab_bytes) if b is None), *range(len(vocab_bytes), words * 32)]:
            base[t // 32] &= ~(1 << (t % 32))
        self.rows = []
        for k in range(len(end)):
            head = end[:k]
            bits = base.copy()
            for t, b in candidates:
                at = (head + b).find(end)
                if at != -1 and at + len(end) < k + len(b):
                    bits[t // 32] &= ~(1 << (t % 32))
            signed = [w - (1 << 32) if w >> 31 else w for w in bits]
            self.rows.append(torch.tensor(signed, dtype=torch.int32))

    def state(self, tail: bytes) -> int:
        """How many of the tag's first bytes `tail` ends with (the most; less than the whole tag)."""
        for k in range(min(len(tail), len(self.end) - 1), 0, -1):
            if tail.endswith(self.end[:k]):
                return k
        return 0


class ReasoningGate(Matcher):
    def __init__(self, inner: Matcher, guard: TagGuard, token_bytes: Callable[[list[int]], bytes]) -> None:
        self.inner, self.guard = inner, guard
        self._end = guard.end
        self._bytes = token_bytes
        self._tail = b""  # thinking: the last len(end) - 1 bytes of the output
        self._state = 0  # thinking: guard.state(_tail)
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
            row.copy_(self.guard.rows[self._state])
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
            tail = window[-(len(end) - 1) :] if len(end) > 1 else b""
        self._tail, self._state = tail, self.guard.state(tail)
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
