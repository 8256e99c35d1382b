"""The OpenAI-compatible HTTP endpoints of the gateway: `/v1/completions` and `/v1/chat/completions`
(JSON and SSE; the work is openai_serving.py's, shared with the bus API), and SGLang's `/tokenize` and
`/detokenize` (also under /v1/). Errors have OpenAI's shape (a body over the size limit: 413). A body
from OFF_LOOP_BYTES on is decoded and checked on the tokenizer's threads, not the event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from services.gateway.generate_input import check_vocabulary, decode_json
from services.gateway.http_auth import caller_of
from services.gateway.http_util import BodyBudget, BodyTooLarge, json_response, read_json, wait_or_disconnect
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_requests import is_int
from services.gateway.openai_serving import OFF_LOOP_BYTES, OpenAIServing, Submitted
from services.gateway.service import Gateway


def openai_error(e: OpenAIError) -> Response:
    return json_response(e.body(), e.status)


def openai_routes(gw: Gateway, budget: BodyBudget | None = None) -> list[Route]:
    limit = gw.cfg.max_body_bytes

    async def body_of(request: Request) -> bytes:
        """The body's bytes (decoded where its size decides: `OpenAIServing.parse`, `worked`);
        OpenAIError 413 past the size limit."""
        try:
            return await read_json(request, limit, parse=False, budget=budget)
        except BodyTooLarge as e:
            raise OpenAIError(str(e), None, e.status) from None

    async def completions(request: Request) -> Response:
        return await serve(request, "completion")

    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat")

    async def serve(request: Request, kind: str) -> Response:
        serving = gw.openai
        try:
            _, parsed = await serving.parse(kind, await body_of(request))
            if isinstance(parsed, OpenAIError):
                raise parsed
            sub = await serving.submit(*parsed, caller_of(request.scope).owner)
        except OpenAIError as e:
            return openai_error(e)
        except ValueError as e:  # a check below the OpenAI layer's own: still the request's fault
            return openai_error(OpenAIError(str(e)))
        if sub.req.stream:
            return StreamingResponse(_sse(serving, sub), media_type="text/event-stream")
        try:
            answered, result = await wait_or_disconnect(request, serving.answer(sub))
        except OpenAIError as e:
            return openai_error(e)
        return json_response(result) if answered else Response(status_code=499)

    async def worked(
        request: Request, work: Callable[[Any], dict[str, Any]], always: bool = False
    ) -> Response:
        """work(the decoded body) -> the response object; on the tokenizer's threads for a body from
        OFF_LOOP_BYTES on, or always (tokenizing text takes a while); OpenAIError: its response."""
        try:
            data = await body_of(request)
            if always or len(data) >= OFF_LOOP_BYTES:
                return json_response(await gw.requests.off_loop(_decoded, work, data))
            return json_response(_decoded(work, data))
        except OpenAIError as e:
            return openai_error(e)

    def tokenize_body(obj: Any) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise OpenAIError("the request body must be a JSON object")
        prompt, special = obj.get("prompt"), obj.get("add_special_tokens", True)
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise OpenAIError("prompt must be a string or a non-empty list of strings", "prompt")
        if not isinstance(special, bool):
            raise OpenAIError("add_special_tokens must be true or false", "add_special_tokens")
        ids = [gw.requests.tokenizer.encode(t, add_special_tokens=special) for t in texts]
        one = isinstance(prompt, str)
        return {
            "tokens": ids[0] if one else ids,
            "count": len(ids[0]) if one else [len(i) for i in ids],
            "max_model_len": gw.requests.context_len,
        }

    def detokenize_body(obj: Any) -> dict[str, Any]:
        tokens = obj.get("tokens") if isinstance(obj, dict) else None
        one = isinstance(tokens, list) and all(is_int(t) for t in tokens)
        rows = [tokens] if one else tokens
        if not isinstance(rows, list) or not all(
            isinstance(r, list) and all(is_int(t) for t in r) for r in rows
        ):
            raise OpenAIError("tokens must be a list of token ids or a list of such lists", "tokens")
        for r in rows:
            try:
                check_vocabulary(r, gw.requests.vocab_size)
            except ValueError as e:
                raise OpenAIError(str(e), "tokens") from None
        skip = bool(obj.get("skip_special_tokens", False))
        texts = [gw.requests.tokenizer.decode(r, skip_special_tokens=skip) for r in rows]
        return {"text": texts[0] if one else texts}

    async def tokenize(request: Request) -> Response:
        return await worked(request, tokenize_body, always=True)

    async def detokenize(request: Request) -> Response:
        return await worked(request, detokenize_body)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
    ]


def _decoded(work: Callable[[Any], dict[str, Any]], data: bytes) -> dict[str, Any]:
    try:
        obj = decode_json(data)
    except ValueError as e:
        raise OpenAIError(str(e)) from None
    return work(obj)


async def _sse(serving: OpenAIServing, sub: Submitted) -> AsyncIterator[bytes]:
    async for payload in serving.chunks(sub):
        yield b"data: " + orjson.dumps(payload) + b"\n\n"
    yield b"data: [DONE]\n\n"
