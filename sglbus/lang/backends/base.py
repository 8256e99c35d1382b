"""The backend interface: every model call the interpreter makes, in plain data.

Prompts are strings and results are `(text, meta_info)`, so a backend can be our server over HTTP,
the in-process Engine, an OpenAI-compatible API or the NATS bus; the interpreter does not know
which. Backends that speak the native `/generate` request format share `NativeBackend`.
"""

from __future__ import annotations

import sys
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sglbus.lang.chat import ChatTemplate
from sglbus.lang.choices import ChoiceDecision, ChoiceMethod
from sglbus.lang.global_config import global_config
from sglbus.lang.params import SamplingParams

if TYPE_CHECKING:
    from sglbus.lang.speculation import Speculation

DEFAULT_IMAGE_TOKEN = "<image>"  # LLaVA's (LlavaConfig's image_token_index 32000 is `<image>`)


class Backend(ABC):
    # API speculative execution (`@sgl.function(num_api_spec_tokens=...)`) only needs `generate`: a
    # completion-style backend speculates on continued text, a chat one (sgl.OpenAI) per assistant turn.
    # A backend that sets this False has programs with num_api_spec_tokens run without speculation.
    supports_api_speculative_execution = True
    # whether the backend sends a prompt's images (`image_data`) with it: the native backends do. A
    # backend that does reads them from the prompt (`sglbus.lang.interpreter.prompt_images`).
    sends_images = False

    @abstractmethod
    def generate(self, prompt: str, params: SamplingParams) -> tuple[str | list[str], Any]:
        """The continuation of prompt and the runtime's meta_info (lists of both when n > 1)."""

    @abstractmethod
    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[tuple[str, Any]]:
        """The continuation as (new text, meta_info so far) pieces."""

    def generate_batch(
        self, prompts: list[str], params: list[SamplingParams]
    ) -> list[tuple[str | list[str], Any] | Exception]:
        """Independent gens at once (compiler mode sends the ready gens of all streams together): per
        prompt its result, or the exception its call raised, so one bad prompt fails only its own gen.
        This default calls generate for each; a backend with a batch API sends one request."""
        out: list[tuple[str | list[str], Any] | Exception] = []
        for prompt, p in zip(prompts, params, strict=True):
            try:
                out.append(self.generate(prompt, p))
            except Exception as e:
                out.append(e)
        return out

    @abstractmethod
    def select(self, prompt: str, choices: list[str], method: ChoiceMethod) -> ChoiceDecision:
        """Which choice continues prompt best, by method, with the scores in meta_info."""

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate: ...

    @abstractmethod
    def get_model_info(self) -> dict[str, Any]:
        """At least model_path and has_image_understanding."""

    def speculation(self, num_tokens: int) -> Speculation:
        """The per-state matcher of `@sgl.function(num_api_spec_tokens=...)`."""
        from sglbus.lang.speculation import Speculation

        return Speculation(self, num_tokens)

    def cache_prefix(self, prefix: str) -> None:  # noqa: B027 (a hint: doing nothing is a valid answer)
        """A hint that several calls will start with prefix (before a fork, before a batch). A backend
        without a prefix cache has nothing to do with it."""

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """Empty the prefix cache. empty_cache: SGLang's server also releases the freed GPU memory
        then; a backend without such a step ignores it."""
        raise NotImplementedError(f"{type(self).__name__} has no cache to flush")

    def get_server_info(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} has no server info")

    def check_media(self, kind: str, source: Any) -> None:
        """Raise unless the model can take an image / a video (as images) through this backend: before
        anything is read, so a text model refuses at once."""
        if not self.sends_images:
            raise ValueError(
                f"{kind}: {type(self).__name__} does not send {kind}s to the model; sgl.RuntimeEndpoint "
                "and the Engine do, for a vision-language model"
            )
        info = self.get_model_info()
        if not info.get("has_image_understanding"):
            raise ValueError(
                f"{kind}: the model {info.get('model_path')!r} is a text-only model "
                f"(has_image_understanding is false); {kind}s need a multimodal model"
            )

    def image_token(self) -> str:
        """The text of the model's image token, which `sgl.image` puts in the prompt where the image
        goes (the runtime expands it into the image's slots). LLaVA's `<image>` unless the backend
        knows better."""
        return DEFAULT_IMAGE_TOKEN


_engine_backends: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()


def set_default_backend(backend: Any) -> None:
    """The backend programs use when run() is given none: a Backend, an `sglbus.Engine` or an
    `sgl.Runtime`. Kept in `sgl.global_config.default_backend`."""
    global_config.default_backend = resolve_backend(backend)


def get_default_backend() -> Backend | None:
    if global_config.default_backend is None:
        return None
    return resolve_backend(global_config.default_backend)


def resolve_backend(backend: Any) -> Backend:
    """backend as a Backend: itself, an Engine wrapped, a Runtime's endpoint, or the default one."""
    if backend is None:
        backend = global_config.default_backend
        if backend is None:
            raise ValueError("no backend: pass backend=... or call sgl.set_default_backend(...) first")
    if isinstance(backend, Backend):
        return backend
    endpoint = getattr(backend, "endpoint", None)  # sgl.Runtime: SGLang's programs pass it as a backend
    if isinstance(endpoint, Backend):
        return endpoint
    engine_module = sys.modules.get("sglbus.engine")  # only loaded (with torch) if an Engine exists
    if engine_module is not None and isinstance(backend, engine_module.Engine):
        from sglbus.lang.backends.engine import EngineBackend

        if backend not in _engine_backends:  # one wrapper per engine: its chat template is derived once
            _engine_backends[backend] = EngineBackend(backend)
        return _engine_backends[backend]
    raise TypeError(
        f"a backend must be sgl.RuntimeEndpoint(url), sgl.Engine(...), sgl.Runtime(...) or another "
        f"sglbus.lang Backend, got {type(backend).__name__}"
    )
