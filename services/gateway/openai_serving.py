"""One OpenAI request from body to answer, for HTTP (openai_api.py) and the bus API (bus_api.py) alike:
checked under OpenAI's names (openai_requests.py), turned into a `/generate` request that goes the
usual way through the RequestManager, and its results shaped back (openai_responses.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.generate_input import GenerateInput, decode_json, parse_generate_input
from services.gateway.openai_errors import OpenAIError, server_error
from services.gateway.openai_images import (
    check_image_tokens,
    content_chars,
    image_error,
    image_parts,
    template_messages,
    template_takes_parts,
)
from services.gateway.openai_requests import OpenAIRequest, parse_chat, parse_completion
from services.gateway.openai_responses import StreamShaper, chat_response, completion_response
from services.gateway.request_manager import RequestManager
from shared.media import MediaError
from shared.transport import BusUnavailable

KINDS = ("completion", "chat")
# bodies from this size on are decoded and checked on the tokenizer's threads: on the event loop a
# large one would hold every other client (JSON and the checks cost ~25 ms a MiB: 0.8 s for the ids of
# a 32 MiB prompt); below it the hop to a thread costs more than the parse
OFF_LOOP_BYTES = 64 << 10


@dataclass
class Submitted:
    req: OpenAIRequest
    gen: GenerateInput
    states: list
    prompt_texts: list[str]  # for echo


# whether the body asked for a stream; the request and the /generate request it becomes, or why not
Parsed = tuple[bool, tuple[OpenAIRequest, GenerateInput] | OpenAIError]


class OpenAIServing:
    def __init__(
        self,
        requests: RequestManager,
        models: Callable[[], tuple[str, ...]],
        reasoning_parser: str | None = None,
    ) -> None:
        """models: the names a request may give as `model` (the first is the served name);
        reasoning_parser: the server's --reasoning-parser (openai_reasoning.py)."""
        self.requests, self.models, self.reasoning_parser = requests, models, reasoning_parser
        self.tokenizer = requests.tokenizer

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat messages through the model's chat template, as token ids; messages far too long for the
        context are refused before (templating and tokenizing megabytes takes seconds). A vision-language
        model's messages go as its template reads them, with its image token for each image part
        (openai_images.py), and the ids must hold one image token per part."""
        chars = sum(content_chars(m["content"]) for m in messages)
        try:
            self.requests.prompt_tokens.refuse_far_too_long(chars)
        except ValueError as e:
            raise OpenAIError(str(e), "messages") from None
        images = self.requests.images
        if images is not None:
            parts = image_parts(messages)
            takes_parts = template_takes_parts(getattr(self.tokenizer, "chat_template", None))
            messages = template_messages(messages, images.image_token, takes_parts)
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        ids = list(out["input_ids"])
        if images is not None:
            check_image_tokens(ids, images.image_token_id, images.image_token, parts)
        return ids

    async def parse(self, kind: str, data: bytes) -> Parsed:
        """The body checked under OpenAI's names and as the `/generate` request it becomes: whether it
        asked for a stream (a refused stream still ends as one on the bus) and the pair, or why not.
        A chat (its template and tokenizer take a while) and any body from OFF_LOOP_BYTES on are
        parsed on the tokenizer's threads, so the event loop keeps answering meanwhile."""
        if kind == "chat" or len(data) >= OFF_LOOP_BYTES:
            return await self.requests.off_loop(self.parse_here, kind, data)
        return self.parse_here(kind, data)

    def parse_here(self, kind: str, data: bytes) -> Parsed:
        """`parse` on the calling thread."""
        stream = b'"stream"' in data  # a guess until it decodes
        try:
            body = decode_json(data)
            stream = isinstance(body, dict) and body.get("stream") is True
            if kind == "chat":
                takes_images = self.requests.images is not None
                req = parse_chat(body, self.models(), self.render, self.reasoning_parser, takes_images)
            else:
                req = parse_completion(body, self.models())
            return stream, (req, parse_generate_input(req.generate, self.requests.max_request_states))
        except OpenAIError as e:
            return stream, e
        except ValueError as e:  # invalid JSON, or the /generate request's own checks
            return stream, OpenAIError(str(e))

    async def submit(self, req: OpenAIRequest, gen: GenerateInput, owner: str = "") -> Submitted:
        """Queued (`parse` gives the pair); OpenAIError when it cannot be (nothing was queued then).
        owner: who may abort it by its rid (http_auth.Caller)."""
        try:
            states = await self.requests.submit(gen, owner)
        except MediaError as e:  # an image that does not decode, or too many: named by its chat part
            raise image_error(e, req.image_params) from None
        except ValueError as e:  # the checks every request passes (prompt length, vocabulary, grammar)
            raise OpenAIError(str(e)) from None
        except BusUnavailable as e:
            status = getattr(e, "status", 503)  # 429: this client's own bound
            raise server_error(f"the request could not be queued: {e}; retry", status) from None
        texts: list[str] = []
        if req.echo:  # each prompt's text, as sent or its ids decoded
            texts = [
                p.text if p.text is not None else self.tokenizer.decode(p.input_ids or [])
                for p in gen.prompts
            ]
        return Submitted(req, gen, states, texts)

    async def answer(self, sub: Submitted) -> dict[str, Any]:
        """The whole response object (a cancelled wait aborts what is unfinished); OpenAIError when
        the server failed the request."""
        results = await self.requests.wait(sub.states)
        failed = next((st.failure for st in results if st.failure is not None), None)
        if failed is not None:
            raise server_error(failed.message, failed.status_code or 500)
        created = int(time.time())
        if sub.req.kind == "chat":
            return chat_response(sub.req, results, created, self.requests.prompt_tokens.token_bytes)
        return completion_response(sub.req, results, sub.prompt_texts, created)

    async def chunks(self, sub: Submitted) -> AsyncIterator[dict[str, Any]]:
        """The stream's payloads: chunks, an error object where the server failed a choice, the usage
        chunk when asked for (the caller ends the stream: `data: [DONE]` over HTTP)."""
        shaper = StreamShaper(sub.req, sub.prompt_texts, self.requests.prompt_tokens.token_bytes)
        async for delta in self.requests.stream(sub.states):
            failed = delta.state.failure if delta.finish is not None else None
            if failed is not None:
                yield server_error(failed.message, failed.status_code or 500).body()
                continue
            for out in shaper.chunks(delta):
                yield out
        if sub.req.include_usage:
            yield shaper.usage_chunk()
