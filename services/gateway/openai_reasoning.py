"""SGLang's reasoning parser on `/v1/chat/completions` (`--reasoning-parser`, shared/reasoning_parser.py).

With a parser set and the request's `separate_reasoning` true (the default, as SGLang's), each choice's
reasoning goes to `message.reasoning_content` (null when it has none; streamed: `delta.reasoning_content`)
and the rest to `content`, which tool calls are then read from. `stream_reasoning: false` sends a
choice's reasoning in one chunk when it ends. Without a parser, or with `separate_reasoning: false`,
the answer is as if this module did not exist: no `reasoning_content` key (SGLang, too, ignores the
fields then)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.openai_errors import OpenAIError
from shared.reasoning_parser import ReasoningParser


@dataclass(frozen=True)
class ReasoningPlan:
    model_type: str  # the server's --reasoning-parser
    stream_reasoning: bool

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.model_type, self.stream_reasoning)


def plan_reasoning(obj: dict[str, Any], model_type: str | None) -> ReasoningPlan | None:
    """A chat request's plan: None when the server has no parser or the request keeps the reasoning
    in `content` (separate_reasoning: false). The fields are checked either way (a completion request's
    too, where they are not used). A grammar on the answer of a model that reasons first applies after
    its reasoning (`require_reasoning`, openai_requests.py), so the answer splits as any other."""
    flags = {}
    for key in ("separate_reasoning", "stream_reasoning"):
        value = True if obj.get(key) is None else obj[key]  # SGLang's default
        if not isinstance(value, bool):
            raise OpenAIError(f"{key} must be true or false", key)
        flags[key] = value
    if model_type is None or not flags["separate_reasoning"]:
        return None
    return ReasoningPlan(model_type, flags["stream_reasoning"])


def split_answer(plan: ReasoningPlan | None, text: str) -> tuple[dict[str, Any], str]:
    """A whole answer -> (the message's reasoning field: {} without a plan; the rest of the text)."""
    if plan is None:
        return {}, text
    reasoning, rest = plan.parser().parse_non_stream(text)
    return {"reasoning_content": reasoning}, rest


class ReasoningStreams:
    """The choices of one streamed chat, each with its own parser (n > 1: one per choice)."""

    def __init__(self, plan: ReasoningPlan | None) -> None:
        self.plan = plan
        self._parsers: dict[int, ReasoningParser] = {}

    def split(self, i: int, text: str, last: bool) -> tuple[str, str]:
        """Choice i's new text -> (new reasoning, new answer text); `last`: its stream ends here."""
        if self.plan is None:
            return "", text
        parser = self._parsers.get(i)
        if parser is None:
            parser = self._parsers[i] = self.plan.parser()
        reasoning, rest = parser.parse_stream_chunk(text)
        if last:
            more, tail = parser.flush()
            reasoning, rest = reasoning + more, rest + tail
            del self._parsers[i]
        return reasoning, rest
