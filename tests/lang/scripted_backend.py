"""A native backend without a model, for the language's unit tests: it "continues" fixed scripts.

A prompt that is a prefix of a script is continued by the script's next characters (one character is
one token here): at most max_new_tokens of them, cut at the first stop string; any other prompt gets
nothing. Every request body is recorded, so a test can count the calls a program makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sglbus.lang.backends.native import NativeBackend
from sglbus.lang.chat import ChatTemplate
from sglbus.lang.chat_template import get_chat_template


class ScriptedBackend(NativeBackend):
    def __init__(self, *scripts: str, template: str = "default") -> None:
        self.scripts, self.chat_template = scripts, get_chat_template(template)
        self.bodies: list[dict[str, Any]] = []
        self.flushed: list[bool] = []

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_info(self) -> dict[str, Any]:
        return {"model_path": "scripted", "has_image_understanding": False}

    def flush_cache(self, empty_cache: bool = True) -> bool:
        self.flushed.append(empty_cache)
        return True

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": "scripted"}

    def _request(self, body: dict[str, Any]) -> Any:
        self.bodies.append(body)
        if isinstance(body["text"], list):
            return [self._continue(t, body["sampling_params"]) for t in body["text"]]
        return self._continue(body["text"], body["sampling_params"])

    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.bodies.append(body)
        whole = self._continue(body["text"], body["sampling_params"])
        for i in range(1, len(whole["text"]) + 1):
            yield {"text": whole["text"][:i], "meta_info": whole["meta_info"]}

    def _continue(self, prompt: str, sampling: dict[str, Any]) -> dict[str, Any]:
        script = next((s for s in self.scripts if s.startswith(prompt)), prompt)
        rest = script[len(prompt) :]
        limit = sampling.get("max_new_tokens", 128)
        text, reason = rest[:limit], {"type": "length" if len(rest) > limit else "stop"}
        hits = [(i, s) for s in sampling.get("stop", []) if (i := text.find(s)) != -1]
        if hits:
            end, stop = min(hits)
            text, reason = text[:end], {"type": "stop", "matched": stop}
        meta = {"prompt_tokens": len(prompt), "completion_tokens": len(text), "finish_reason": reason}
        return {"text": text, "meta_info": meta}
