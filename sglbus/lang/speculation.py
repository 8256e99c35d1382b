"""API speculative execution (the SGLang paper, §5), for a backend whose API cannot continue a
half-written reply (a chat model) or where one call per gen would pay for the whole prompt each time:
the first gen of a stretch asks for more tokens than it needs, and the program's own text and its
later gens are matched against that speculated reply. `Backend.speculation` makes one per program
state (`@sgl.function(num_api_spec_tokens=N)`); on a completion-style backend (the native ones, or
sgl.OpenAI with a completion model) it continues the text, as SGLang's does on any non-chat backend."""

from __future__ import annotations

import dataclasses
from typing import Any

from sglbus.lang.backends.base import Backend
from sglbus.lang.interpreter import ChatPrompt
from sglbus.lang.params import SamplingParams


class Speculation:
    """One program state's speculated text. The executor tells it the program's text (`fill`) and asks
    it for each gen (`generate`); role boundaries `reset` it. A gen is answered from the speculated
    rest when its stop string is there (or the model ended its reply there), else a call is made:
    for a completion model one that continues the text; for a chat model one for the whole assistant
    turn, whose reply must start with what the program already wrote in that turn."""

    def __init__(self, backend: Backend, num_tokens: int, max_tries: int = 3) -> None:
        self.backend, self.num_tokens, self.max_tries = backend, num_tokens, max_tries
        self.rest: str | None = None  # speculated text the program has not used yet; None: nothing
        self.complete = False  # the model ended its reply where `rest` ends (not cut by the token limit)
        self.turn_calls = 0  # calls made for the open chat turn
        self.reply: str | None = None  # the last speculated reply, for the error when none matches

    def reset(self) -> None:
        self.rest, self.turn_calls, self.reply = None, 0, None

    def fill(self, text: str) -> None:
        self.rest = consume(self.rest, text)

    def generate(self, prompt: str, params: SamplingParams) -> tuple[str | list[str], Any]:
        if params.n not in (None, 1) or params.dtype or params.regex or params.json_schema:
            self.rest = None  # a constrained or multi-sample gen is no continuation of free text
            return self.backend.generate(prompt, params)
        if self.rest is not None:
            if (got := take(self.rest, params.stops(), self.complete)) is not None:
                text, self.rest = got
                return text, {"api_speculative": "matched"}
            if isinstance(prompt, ChatPrompt) and prompt.role_text.strip():
                raise self._cut(params)
        if isinstance(prompt, ChatPrompt):
            return self._chat_turn(prompt, params)
        reply, meta = self._speculate(prompt, params)
        self.rest = reply
        if (got := take(reply, params.stops(), self.complete)) is None:  # cut before the gen's end
            self.rest = None
            return self.backend.generate(prompt, params)
        text, self.rest = got
        return text, {**meta, "api_speculative": "call"}

    def _chat_turn(self, prompt: ChatPrompt, params: SamplingParams) -> tuple[str, Any]:
        written = prompt.role_text
        # a new call at temperature 0 would give the same reply: one try per turn
        tries = 1 if params.temperature == 0 else self.max_tries
        while self.turn_calls < tries:
            self.turn_calls += 1
            reply, meta = self._speculate(prompt.turn_start(), params)
            rest = after_prefix(reply, written)
            if rest is None:
                continue
            got = take(rest, params.stops(), self.complete)
            if got is None:
                if written.strip():
                    raise self._cut(params)
                self.rest = None  # the gen opens the turn: an ordinary call answers it
                return self.backend.generate(prompt, params)
            text, self.rest = got
            return text, {**meta, "api_speculative": "call"}
        last = f" (the reply: {self.reply!r})" if self.reply is not None else ""
        raise RuntimeError(
            f"API speculative execution: this assistant turn's reply{last} does not go on with the "
            f"program's text {written[-60:]!r} after {self.turn_calls} call(s), and a chat API cannot "
            "continue a partial reply; let the few-shot examples show the exact format, or use a "
            "completion model (is_chat_model=False)"
        )

    def _cut(self, params: SamplingParams) -> RuntimeError:
        return RuntimeError(
            f"API speculative execution: the speculated reply (at most {self.num_tokens} tokens, or the "
            f"gen's max_tokens) ended before this gen's stop {params.stops()}, and a chat API cannot "
            "continue a partial reply; raise num_api_spec_tokens"
        )

    def _speculate(self, prompt: str, params: SamplingParams) -> tuple[str, Any]:
        wide = dataclasses.replace(params, max_new_tokens=max(self.num_tokens, params.max_new_tokens or 0),
                                   stop=[], stop_token_ids=[], stop_regex=[])  # fmt: skip
        reply, meta = self.backend.generate(prompt, wide)
        assert isinstance(reply, str)
        self.reply, self.complete = reply, _ended(meta)
        return reply, meta


def _ended(meta: Any) -> bool:
    """Whether the model ended its reply itself (rather than at the token limit)."""
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(reason, dict):  # the native shape
        reason = reason.get("type")
    return reason == "stop"


def consume(rest: str | None, text: str) -> str | None:
    """The speculated rest after the program's own text; None when the text is not what was speculated."""
    if rest is None or not rest.startswith(text):
        return None
    return rest[len(text) :]


def after_prefix(reply: str, written: str) -> str | None:
    """A chat turn's reply after what the program already wrote in the turn (leading whitespace aside,
    as the turn's message content is stripped); None when the reply does not start with it."""
    if not written:
        return reply
    reply, written = reply.lstrip(), written.lstrip()
    return reply[len(written) :] if reply.startswith(written) else None


def take(rest: str, stops: list[str], complete: bool) -> tuple[str, str] | None:
    """A gen's text out of the speculated rest, and the rest after it: up to the first of its stop
    strings (which stays in the rest, for the program's next text to match); all of it when the model
    ended its reply there; None when the reply was cut by the token limit before any stop."""
    hits = [i for s in stops if (i := rest.find(s)) != -1]
    if hits:
        end = min(hits)
        return rest[:end], rest[end:]
    if complete:
        return rest, ""
    return None
