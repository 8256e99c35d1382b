"""The OpenAI shaper: the gateway's finished request states and stream deltas (`request_state.py`) in
OpenAI's shapes: the `text_completion` and `chat.completion` objects, their stream chunks, logprobs as
each endpoint writes them, usage with `prompt_tokens_details.cached_tokens`.

Choices run prompt by prompt, n per prompt (choice index = prompt * n + sample), as OpenAI orders them.
finish_reason: stop (EOS, a stop string or id, a grammar's end), length, tool_calls (chat, tool calls
found), abort (the request was aborted without an error)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from services.gateway.openai_reasoning import ReasoningStreams, split_answer
from services.gateway.openai_requests import OpenAIRequest
from services.gateway.request_state import Delta, RequestState
from shared.finish import api_name

TokenBytes = Callable[[int, str], list[int]] | None  # (token id, its text) -> its own bytes


def usage(req: OpenAIRequest, results: list[RequestState]) -> dict[str, Any]:
    """n samples of a prompt count its prompt (and its cached part) once."""
    groups = [results[i : i + req.n] for i in range(0, len(results), req.n)]
    prompt = sum(g[0].prompt_tokens for g in groups)
    cached = sum(min(st.cached_tokens for st in g) for g in groups)
    completion = sum(len(st.output_ids) for st in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_response(
    req: OpenAIRequest, results: list[RequestState], prompt_texts: list[str], created: int
) -> dict[str, Any]:
    choices = []
    for i, st in enumerate(results):
        text = (prompt_texts[i // req.n] if req.echo else "") + st.text
        lp = completion_logprobs(st.logprob_meta(), req.echo) if req.top_logprobs is not None else None
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": api_name(st.finish)})
    return _response(req, "text_completion", choices, results, created)


def chat_response(
    req: OpenAIRequest, results: list[RequestState], created: int, token_bytes: TokenBytes = None
) -> dict[str, Any]:
    choices = []
    for i, st in enumerate(results):
        reasoning, text = split_answer(req.reasoning, st.text)
        message: dict[str, Any] = {"role": "assistant", "content": text, **reasoning}
        reason = api_name(st.finish)
        if req.tools is not None:
            content, calls = req.tools.parse(text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" or req.tools.schema is not None else reason
        lp = (
            {"content": chat_logprobs(st.logprob_meta(), token_bytes)}
            if req.top_logprobs is not None
            else None
        )
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
    return _response(req, "chat.completion", choices, results, created)


def _response(req: OpenAIRequest, kind: str, choices: list, results: list, created: int) -> dict[str, Any]:
    return {"id": req.generate["rid"], "object": kind, "created": created, "model": req.model,
            "choices": choices, "usage": usage(req, results), "system_fingerprint": None}  # fmt: skip


def completion_logprobs(meta: dict[str, Any], echo: bool, text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions logprobs of the rows in `meta` (with echo, the prompt's
    rows first; its first token has no logprob)."""
    rows: list[Any] = list(meta.get("input_token_logprobs") or []) if echo else []
    tops: list[Any] = list(meta.get("input_top_logprobs") or []) if echo else []
    tops += [None] * (len(rows) - len(tops))
    rows += meta.get("output_token_logprobs", [])
    tops += meta.get("output_top_logprobs", [])
    tops += [[]] * (len(rows) - len(tops))  # logprobs=0: one (empty) entry per token, as OpenAI's
    del tops[len(rows) :]  # max_tokens=0: the row of the next position has no token (one entry per token)
    offsets, at = [], text_offset
    for row in rows:
        offsets.append(at)
        at += len(row[2] or "")
    return {
        "tokens": [row[2] for row in rows],
        "token_logprobs": [row[0] for row in rows],
        "top_logprobs": [None if top is None else {t[2]: t[0] for t in top} for top in tops],
        "text_offset": offsets,
    }


def chat_logprobs(meta: dict[str, Any], token_bytes: TokenBytes = None) -> list[dict[str, Any]]:
    """token_bytes(id, text): a token's own bytes (a token that is part of a UTF-8 character has the
    replacement character as its text); None: its text's."""
    rows = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs", [])[: len(rows)]  # max_tokens=0: a next-position row, no token

    def token(row: list[Any]) -> dict[str, Any]:
        text = row[2] or ""
        raw = token_bytes(row[1], text) if token_bytes is not None else list(text.encode("utf-8"))
        return {"token": text, "logprob": row[0], "bytes": raw}

    return [
        {**token(row), "top_logprobs": [token(t) for t in (top or [])]}
        for row, top in zip(rows, tops + [None] * (len(rows) - len(tops)), strict=True)
    ]


class StreamShaper:
    """The RequestManager's deltas (one choice each: `index`, the new text and logprob rows, the finish
    reason at the end) -> OpenAI's chunks. With tools (chat,
    tool_choice not "none") a choice's answer is held until it is complete, then sent as content or
    tool_calls: a call cannot be told from text before it ends (its logprob rows with it). With the
    reasoning apart (openai_reasoning.py), a chat's reasoning goes as `reasoning_content`, tools or not."""

    def __init__(self, req: OpenAIRequest, prompt_texts: list[str], token_bytes: TokenBytes = None) -> None:
        self.req, self.prompt_texts, self.token_bytes = req, prompt_texts, token_bytes
        self.created = int(time.time())
        self._offset: dict[int, int] = {}  # text sent per choice (completions' logprob text_offset)
        self._held: dict[int, str] = {}  # with tools: the answer so far
        self._held_rows: dict[int, list] = {}  # with tools: its logprob rows not sent yet
        self._reasoning = ReasoningStreams(req.reasoning)
        self._finals: dict[int, RequestState] = {}
        self.chat = req.kind == "chat"

    def chunks(self, delta: Delta) -> list[dict[str, Any]]:
        """The OpenAI chunks one delta of a choice gives."""
        i, text, meta = delta.index, delta.text, delta.logprobs or {}
        reason = api_name(delta.finish)
        out = []
        if i not in self._offset:  # the choice's first chunk
            self._offset[i], self._held[i], self._held_rows[i] = 0, "", []
            if self.chat:
                out.append(self._chunk(i, {"role": "assistant", "content": ""}, None))
            elif self.req.echo:
                echo = self.prompt_texts[i // self.req.n]
                out.append(self._chunk(i, echo, None, self._logprobs(i, meta, prompt_only=True)))
                self._offset[i] = len(echo)
        if reason is not None:
            self._finals[i] = delta.state
        if self.chat:
            return out + self._chat_chunks(i, text, meta, reason)
        lp = self._logprobs(i, meta)
        self._offset[i] += len(text)
        if text or lp is not None or reason is not None:
            out.append(self._chunk(i, text, reason, lp))
        return out

    def _chat_chunks(
        self, i: int, text: str, meta: dict[str, Any], reason: str | None
    ) -> list[dict[str, Any]]:
        reasoning, text = self._reasoning.split(i, text, reason is not None)
        body: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        lp = self._logprobs(i, meta)
        if self.req.tools is not None:  # the answer held until complete
            self._held[i] += text
            self._held_rows[i] += lp["content"] if lp is not None else []
            if reason is None and not reasoning:
                return []
            rows, self._held_rows[i] = self._held_rows[i], []
            lp = {"content": rows} if rows else None
            if reason is not None:
                content, calls = self.req.tools.parse(self._held[i])
                if content:
                    body["content"] = content
                if calls:
                    body["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                    reason = "tool_calls" if reason == "stop" or self.req.tools.schema is not None else reason
            return [self._chunk(i, body, reason, lp)]
        if text or not reasoning:
            body["content"] = text
        if text or reasoning or lp is not None or reason is not None:
            return [self._chunk(i, body, reason, lp)]
        return []

    def usage_chunk(self) -> dict[str, Any]:
        results = [self._finals[i] for i in sorted(self._finals)]
        return {
            "id": self.req.generate["rid"],
            "object": self._object(),
            "created": self.created,
            "model": self.req.model,
            "choices": [],
            "usage": usage(self.req, results),
        }

    def _logprobs(self, i: int, meta: dict[str, Any], prompt_only: bool = False) -> Any:
        """This delta's rows in the endpoint's shape (None when none were asked for or none are new);
        prompt_only: the echoed prompt's rows (completions, first chunk)."""
        if self.req.top_logprobs is None:
            return None
        if self.chat:
            rows = chat_logprobs(meta, self.token_bytes)
            return {"content": rows} if rows else None
        if prompt_only:
            meta = {k: v for k, v in meta.items() if k.startswith("input_")}
        elif self.req.echo:  # the prompt's rows went with the echo
            meta = {k: v for k, v in meta.items() if not k.startswith("input_")}
        lp = completion_logprobs(meta, self.req.echo, self._offset[i])
        return lp if lp["tokens"] else None

    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, i: int, delta: Any, reason: str | None, lp: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": reason}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {
            "id": self.req.generate["rid"],
            "object": self._object(),
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        }
