"""`sgl.BusEndpoint(nats_url)`: programs over the NATS bus API, for services inside a deployment that
reach the gateways on the bus rather than over HTTP.

The requests are the native `/generate` bodies (`NativeBackend`), sent to `<prefix>.api.generate`
(request/reply; any gateway of the queue group answers). A streamed reply arrives as separate messages
on an inbox, then `[DONE]`. The interpreter is synchronous, so nats-py runs on an event loop thread of
the backend's own, with one connection (shared/nats_transport.py, as the services connect) for all of
the backend's states; `close()` ends both.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

from sglbus.lang.backends.native import NativeBackend
from sglbus.lang.chat import ChatTemplate, template_from_folder
from sglbus.lang.chat_template import get_chat_template, template_for_model

TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
_DONE = b"[DONE]"


class BusEndpoint(NativeBackend):
    # the bus API does not say whether the model takes images (no model info), so none are sent
    sends_images = False

    def __init__(self, nats_url: str, subject_prefix: str = "sglbus", token: str | None = None,
                 user: str | None = None, password: str | None = None, creds: str | None = None,
                 chat_template_name: str | None = None, tokenizer_path: str | None = None,
                 timeout: float = TIMEOUT_S) -> None:  # fmt: skip
        """token / user + password / creds (a .creds file): NATS auth, as the services' BusAuth takes
        it. The bus API does not tell the tokenizer folder, so the chat template is the named one, the
        one in tokenizer_path, or one picked by the model's name (asked once over the bus)."""
        from shared.nats_transport import BusAuth, NatsTransport  # here: `import sglbus` stays cheap

        if not subject_prefix or any(c in subject_prefix for c in " *>"):
            raise ValueError(f"BusEndpoint: subject_prefix must be a NATS subject without wildcards or "
                             f"spaces, got {subject_prefix!r}")  # fmt: skip
        self.subject_prefix, self.timeout = subject_prefix, timeout
        self.subject = f"{subject_prefix}.api.generate"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sglbus-bus-endpoint", daemon=True
        )
        self._thread.start()
        auth = BusAuth(token=token, user=user, password=password, creds=creds)
        try:
            connecting = NatsTransport.connect(nats_url, "sglbus-lang", CONNECT_TIMEOUT_S, auth)
            self.transport = self._call(connecting, CONNECT_TIMEOUT_S + 5)
        except BaseException:
            self._stop_loop()
            raise
        self.model_name = self._model_name()
        if chat_template_name is not None:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            folder = tokenizer_path and template_from_folder(tokenizer_path)
            self.chat_template = folder or template_for_model(self.model_name)

    def get_model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_name, "is_generation": True, "has_image_understanding": False}

    def get_model_name(self) -> str:
        return self.model_name

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def close(self) -> None:
        """Flush and close the connection, then end the loop thread."""
        if self._loop.is_closed():
            return
        try:
            self._call(self.transport.close(), CONNECT_TIMEOUT_S)
        finally:
            self._stop_loop()

    def __enter__(self) -> BusEndpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the bus ---------------------------------------------------------------------------------
    def _request(self, body: dict[str, Any]) -> Any:
        return self._ask(self.subject, body)

    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        messages: queue.Queue[bytes] = queue.Queue()
        data = self._encode(self.subject, body)

        async def start() -> Any:
            async def relay(msg: Any) -> None:
                messages.put(msg.data)

            inbox = self.transport.new_inbox()
            sub = await self.transport.subscribe(inbox, relay)  # in order, one message at a time
            await self.transport.publish(self.subject, data, reply=inbox)
            return sub

        sub = self._call(start(), self.timeout)
        try:
            while True:
                try:
                    chunk = messages.get(timeout=self.timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"{self.subject}: no stream chunk within {self.timeout:.0f} s"
                    ) from None
                if chunk == _DONE:
                    return
                yield self._check(self.subject, json.loads(chunk))
        finally:
            if not self._loop.is_closed():
                self._call(sub.unsubscribe(), CONNECT_TIMEOUT_S)

    def _model_name(self) -> str:
        """The served model's name, from the smallest OpenAI request (no token generated)."""
        subject = f"{self.subject_prefix}.api.completions"
        return str(self._ask(subject, {"prompt": " ", "max_tokens": 0})["model"])

    def _ask(self, subject: str, body: dict[str, Any]) -> Any:
        asked = self.transport.request(subject, self._encode(subject, body), self.timeout)
        try:
            reply = self._call(asked, self.timeout + 5)
        except TimeoutError as e:
            raise TimeoutError(f"{e}: is the server up, and is subject_prefix {self.subject_prefix!r} its "
                               "--subject-prefix?") from None  # fmt: skip
        return self._check(subject, json.loads(reply))

    def _encode(self, subject: str, body: dict[str, Any]) -> bytes:
        data = json.dumps(body).encode()
        if len(data) > self.transport.max_payload:
            raise ValueError(f"{subject}: the request has {len(data)} bytes, over the bus's max payload of "
                             f"{self.transport.max_payload}; use sgl.RuntimeEndpoint (HTTP) for prompts this "
                             "long")  # fmt: skip
        return data

    @staticmethod
    def _check(subject: str, out: Any) -> Any:
        """The reply, or RuntimeError with the gateway's message (the bus API's error shape)."""
        if isinstance(out, dict) and "error" in out and "text" not in out:
            err = out["error"]
            if isinstance(err, dict):
                code = f"error {err['code']}: " if err.get("code") is not None else ""
                raise RuntimeError(f"{subject}: {code}{err.get('message', err)}")
            raise RuntimeError(f"{subject}: {err}")
        return out

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CONNECT_TIMEOUT_S)
        self._loop.close()
