"""The in-process Engine as a backend: `sgl.set_default_backend(sgl.Engine())` runs programs offline,
through the same gateway, scheduler and detokenizer code as the server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sglbus.lang.backends.native import NativeBackend
from sglbus.lang.chat import ChatTemplate, from_jinja
from sglbus.lang.chat_template import get_chat_template, template_for_model


class EngineBackend(NativeBackend):
    def __init__(
        self, engine: Any = None, chat_template_name: str | None = None, **engine_options: Any
    ) -> None:
        """engine: an `sglbus.Engine`; without one, an Engine is made from engine_options and shut
        down by `shutdown()`."""
        if engine is None:
            from sglbus.engine import Engine

            engine, self._owned = Engine(**engine_options), True
        else:
            self._owned = False
        self.engine = engine
        tok = engine.tokenizer
        if chat_template_name is not None:
            self.chat_template = get_chat_template(chat_template_name)
        elif getattr(tok, "chat_template", None):
            name = str(engine.config.model_path or "default model")
            self.chat_template = from_jinja(tok.chat_template, tok.bos_token or "", tok.eos_token or "", name)
        else:
            self.chat_template = template_for_model(str(engine.config.model_path or ""))

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.engine.config.model_path or self.engine.model_folder,
            "tokenizer_path": self.engine.model_folder,
            "is_generation": True,
            "has_image_understanding": self._images() is not None,
            "architectures": [self.engine.model_config.architecture],
        }

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def image_token(self) -> str:
        """The model's image token as the engine's gateway reads it (config.json's image_token_index,
        its text from the tokenizer's added tokens)."""
        images = self._images()
        return images.image_token if images is not None else super().image_token()

    def _images(self) -> Any:
        """The engine's ImageInputs: None for a text model."""
        return getattr(getattr(self.engine, "requests", None), "images", None)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """False while requests run. empty_cache: nothing to release (the KV pool is allocated once)."""
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        if self._owned:
            self.engine.shutdown()

    def _request(self, body: dict[str, Any]) -> Any:
        return self.engine.generate(**body)

    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        body = dict(body)
        del body["stream"]
        return self.engine.generate(**body, stream=True)
