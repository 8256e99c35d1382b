"""The bus API: internal services send SGLang's `GenerateReqInput` JSON to `<prefix>.api.generate`
(request/reply; gateways share the queue group `gateways`, so any one answers).

Reply: the `/generate` response JSON. With `"stream": true`, each chunk arrives as its own message on
the reply subject and `[DONE]` ends the stream. Bad input gets `{"error": {"message", "code": 400}}`
(then `[DONE]` when streaming), with the same message as the HTTP 400. A payload over
`max_request_bytes` (smaller than HTTP's body limit: the bus is shared by every service) gets a 413 at
once, before anything parses it; a bus that cannot take the request gets a 503.

OpenAI's endpoints the same way: `<prefix>.api.completions` and `<prefix>.api.chat_completions` take
the `/v1/completions` and `/v1/chat/completions` bodies and answer with the same objects (streamed: each
chunk its own message, then `[DONE]`); errors in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from services.gateway import sglang_shape
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_serving import OpenAIServing
from services.gateway.request_manager import RequestManager
from shared.transport import BusUnavailable, Message, Transport

log = logging.getLogger(__name__)
END = b"[DONE]"


class BusApi:
    def __init__(self, requests: RequestManager, transport: Transport, max_request_bytes: int,
                 openai: OpenAIServing) -> None:  # fmt: skip
        self.requests, self.transport, self.max_request_bytes = requests, transport, max_request_bytes
        self.openai = openai
        self._tasks: set[asyncio.Task] = set()

    async def on_request(self, m: Message) -> None:
        """A `GenerateReqInput` on `<prefix>.api.generate`."""
        if m.reply:  # fire-and-forget has nobody to answer
            self._start(self._serve(m.data, m.reply))

    async def on_completion(self, m: Message) -> None:
        if m.reply:
            self._start(self._serve_openai(m.data, m.reply, "completion"))

    async def on_chat_completion(self, m: Message) -> None:
        if m.reply:
            self._start(self._serve_openai(m.data, m.reply, "chat"))

    def _start(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # one task per request: the subscription keeps taking new ones
        task.add_done_callback(self._tasks.discard)

    async def _serve_openai(self, data: bytes, reply: str, kind: str) -> None:
        stream = b'"stream"' in data  # a guess until it parses: [DONE] ends even a rejected stream
        try:
            if len(data) > self.max_request_bytes:
                raise OpenAIError(f"the request has {len(data)} bytes, over the bus API's limit of "
                                  f"{self.max_request_bytes}", None, 413)  # fmt: skip
            stream, parsed = await self.openai.parse(kind, data)
            if isinstance(parsed, OpenAIError):
                raise parsed
            sub = await self.openai.submit(*parsed)
            if stream:
                async for payload in self.openai.chunks(sub):
                    await self._send(reply, payload)
            else:
                await self._send(reply, await self.openai.answer(sub))
        except OpenAIError as e:
            await self._send(reply, e.body())
        except Exception as e:  # answer rather than leave the caller waiting
            log.exception("bus API request failed")
            await self._send(reply, {"error": {"message": f"internal error: {e}", "type": "server_error",
                                               "param": None, "code": None}})  # fmt: skip
        if stream:
            await self.transport.publish(reply, END)

    async def _serve(self, data: bytes, reply: str) -> None:
        if len(data) > self.max_request_bytes:  # not parsed: whether it streams is a guess
            message = (
                f"the request has {len(data)} bytes, over the bus API's limit of {self.max_request_bytes}"
            )
            await self._reject(reply, message, 413, b'"stream"' in data)
            return
        stream = False  # [DONE] ends even a rejection of a stream
        try:
            stream, parsed = await self.requests.bodies.parse(data)
            if isinstance(parsed, ValueError):
                raise parsed
            req = parsed
            states = await self.requests.submit(req)
        except ValueError as e:
            await self._reject(reply, str(e), 400, stream)
            return
        except BusUnavailable as e:
            status = getattr(e, "status", 503)  # 429: this client's own bound
            await self._reject(reply, f"the request could not be queued: {e}; retry", status, stream)
            return
        try:
            if stream:
                async for event in self.requests.stream(states):
                    await self._send(reply, sglang_shape.stream_chunk(event, req.is_batch))
                await self.transport.publish(reply, END)
            else:
                await self._send(reply, sglang_shape.results(await self.requests.wait(states), req.is_batch))
        except Exception as e:  # answer rather than leave the caller waiting
            log.exception("bus API request failed")
            await self._send(reply, {"error": {"message": f"internal error: {e}", "code": 500}})

    async def _reject(self, reply: str, message: str, code: int, stream: bool) -> None:
        await self._send(reply, {"error": {"message": message, "code": code}})
        if stream:
            await self.transport.publish(reply, END)

    async def _send(self, reply: str, obj: Any) -> None:
        data = orjson.dumps(obj)
        if len(data) > self.transport.max_payload:
            limit = self.transport.max_payload
            message = (f"the response has {len(data)} bytes, over the bus's max payload of {limit}; "
                       "use HTTP, stream, or the base64 logprob arrays")  # fmt: skip
            data = orjson.dumps({"error": {"message": message, "code": 413}})
        await self.transport.publish(reply, data)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
