"""SGLang's reasoning parser (`--reasoning-parser`): a model's answer split into its reasoning (between
`<think>` and `</think>`, or the model's own tags) and the rest, from the whole text or as it streams.
Pure Python: the gateway's `/v1/chat/completions` uses it, the frontend language may too.

Per model type, as SGLang defines them:
- forced ("deepseek-r1", "qwen3-thinking", "step3"): the text is reasoning from its start (an opening tag
  there is dropped) until the end tag;
- opened ("deepseek-v3", "qwen3", "glm45", "kimi"): reasoning only when the text starts with the opening
  tag (after optional whitespace); otherwise the whole text is the answer, untouched;
- "glm45" also ends its reasoning at `<tool_call>`, which stays in the answer (a call made while thinking).

A reasoning block without its end tag (the output was cut short) is reasoning to the end, and the answer
is "". The reasoning is stripped of surrounding whitespace, the answer of its leading whitespace after
the end tag. Text after the end tag is the answer, tags and all.

Where SGLang differs: its whole-text parse opens reasoning at a `<think>` anywhere in the text (what came
before it counts as reasoning), drops every `<think>`, and strips the answer at both ends, while its
stream parse does not; here only an opening tag at the start opens reasoning, later tags are text, and
the two parses agree.

Stream and whole text agree: the pieces `parse_stream_chunk` and `flush` give, joined, are what
`parse_non_stream` gives for the joined text, however it was cut. A stream holds back only what may
still change meaning: the start of a possible tag and whitespace that may turn out to be stripped
(with stream_reasoning=False, the whole reasoning until it ends).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class _Format:
    start: str
    end: str
    forced: bool  # reasoning from the first character, opening tag or not
    interrupt: str | None = None  # ends the reasoning too, and stays in the answer


_THINK = ("<think>", "</think>")
_FORMATS = {
    "deepseek-r1": _Format(*_THINK, forced=True),
    "deepseek-v3": _Format(*_THINK, forced=False),
    "glm45": _Format(*_THINK, forced=False, interrupt="<tool_call>"),
    "kimi": _Format("◁think▷", "◁/think▷", forced=False),
    "qwen3": _Format(*_THINK, forced=False),
    "qwen3-thinking": _Format(*_THINK, forced=True),
    "step3": _Format(*_THINK, forced=True),
}
REASONING_PARSERS: tuple[str, ...] = tuple(_FORMATS)
# whether a chat model of the type reasons before its answer unless told otherwise (SGLang: deepseek-v3
# thinks only with chat_template_kwargs {"thinking": true}, which this server does not take)
_REASONS_BY_DEFAULT = {t: t != "deepseek-v3" for t in _FORMATS}


# the tags a request's reasoning may end with (GenerateReq.reasoning_end: the scheduler takes no other)
REASONING_ENDS = frozenset(f.end for f in _FORMATS.values())


def reasoning_end(model_type: str) -> str:
    """The tag that ends the reasoning of a model of the type: a request's grammar with
    `require_reasoning` applies after it (SGLang's structured outputs for reasoning models)."""
    return _FORMATS[model_type].end


def reasons_by_default(model_type: str) -> bool:
    """Whether a chat answer of such a model starts with its reasoning (a grammar on it then waits for
    the end tag: the gateway sets `require_reasoning`)."""
    return _REASONS_BY_DEFAULT[model_type]


# where a stream is: before the reasoning could open, inside it, right after it (the answer's leading
# whitespace is dropped), in the answer
_OPENING, _REASONING, _ANSWER_START, _ANSWER = range(4)


class ReasoningParser:
    """One answer's parser: `parse_non_stream` for a whole text (any time, no state), or
    `parse_stream_chunk` for each new piece of a stream and `flush` once it ends."""

    def __init__(
        self, model_type: str, stream_reasoning: bool = True, force_reasoning: bool | None = None
    ) -> None:
        """force_reasoning: whether the text is reasoning from its start without an opening tag (None:
        the model type's own; False for an output a grammar constrained, which has no end tag unless
        the grammar wrote one)."""
        fmt = _FORMATS.get(model_type)
        if fmt is None:
            raise ValueError(
                f"unknown reasoning parser {model_type!r}; allowed: {', '.join(REASONING_PARSERS)}"
            )
        self.model_type, self.stream_reasoning = model_type, stream_reasoning
        self._fmt = fmt if force_reasoning is None else replace(fmt, forced=force_reasoning)
        self._state = _OPENING
        self._pending = ""  # received, not given out: a possible tag's start, whitespace that may go
        self._held = ""  # stream_reasoning=False: the reasoning given out so far, until it ends
        self._began = False  # some reasoning went out (later whitespace is inside it, not leading)

    def parse_non_stream(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None when there is none; the answer)."""
        fmt = self._fmt
        head = text.lstrip()
        opened = head.startswith(fmt.start)
        if not (opened or fmt.forced):
            return None, text
        body = head[len(fmt.start) :] if opened else head
        found = _end_of_reasoning(body, fmt)
        if found is None:
            return body.strip() or None, ""
        at, answer = found
        return body[:at].strip() or None, body[answer:].lstrip()

    def parse_stream_chunk(self, delta: str) -> tuple[str, str]:
        """The next piece of the output -> (new reasoning, new answer); either may be ""."""
        fmt = self._fmt
        self._pending += delta
        reasoning: list[str] = []
        answer: list[str] = []
        while True:  # each pass moves to a later state, or stops to wait for more text
            if self._state == _OPENING:
                head = self._pending.lstrip()
                if head.startswith(fmt.start):
                    self._pending, self._state = head[len(fmt.start) :], _REASONING
                elif fmt.start.startswith(head):  # empty, or the tag's beginning: it may still open
                    break
                elif fmt.forced:
                    self._pending, self._state = head, _REASONING
                else:
                    self._state = _ANSWER
            elif self._state == _REASONING:
                found = _end_of_reasoning(self._pending, fmt)
                if found is None:
                    tail = len(self._pending) - _partial_tag(self._pending, fmt)
                    part = self._pending[:tail].rstrip()  # trailing whitespace waits: the end may follow
                    self._give(part, reasoning)
                    self._pending = self._pending[len(part) :]
                    break
                at, cut = found
                self._give(self._pending[:at].rstrip(), reasoning)
                reasoning.append(self._held)
                self._held, self._pending, self._state = "", self._pending[cut:], _ANSWER_START
            elif self._state == _ANSWER_START:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    break
                self._state = _ANSWER
            else:
                answer.append(self._pending)
                self._pending = ""
                break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """At the end of the stream: what was held back -> (reasoning, answer). A reasoning block
        without its end tag ends here; text that could not open one is the answer."""
        pending, self._pending = self._pending, ""
        reasoning: list[str] = []
        answer = ""
        if self._state == _OPENING and not self._fmt.forced:
            answer = pending
        elif self._state in (_OPENING, _REASONING):
            self._give(pending.rstrip(), reasoning)
        # _ANSWER_START holds only whitespace (dropped); _ANSWER holds nothing
        reasoning.append(self._held)
        self._held = ""
        return "".join(reasoning), answer

    def _give(self, part: str, out: list[str]) -> None:
        """Reasoning text that is final: out now, or held (stream_reasoning=False) until it ends."""
        if not self._began:
            part = part.lstrip()
            self._began = bool(part)
        if self.stream_reasoning:
            out.append(part)
        else:
            self._held += part


def _end_of_reasoning(text: str, fmt: _Format) -> tuple[int, int] | None:
    """Where the reasoning in `text` ends and where the answer begins (after the end tag; at an
    interrupting token, which stays); None when it does not end in `text`."""
    end = text.find(fmt.end)
    stop = text.find(fmt.interrupt) if fmt.interrupt is not None else -1
    if stop >= 0 and (end < 0 or stop < end):
        return stop, stop
    if end >= 0:
        return end, end + len(fmt.end)
    return None


def _partial_tag(text: str, fmt: _Format) -> int:
    """The length of the longest end of `text` that begins a tag ending the reasoning (held back: the
    next piece may complete it)."""
    tags = [fmt.end] if fmt.interrupt is None else [fmt.end, fmt.interrupt]
    for size in range(max(len(t) for t in tags) - 1, 0, -1):
        if any(text.endswith(t[:size]) for t in tags if size < len(t)):
            return size
    return 0
