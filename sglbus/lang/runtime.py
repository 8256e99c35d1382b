"""`sgl.Runtime(model_path=..., **server_args)`: SGLang's way to serve a model from the program's own
process. SGLang's launches its HTTP server in a child process; this one runs the in-process Engine
(the same gateway, scheduler and detokenizer code as the server, without HTTP), so there is no port
and no `url`. What a program uses is there: `endpoint` (the backend; the Runtime itself is accepted
wherever a backend is), `generate`, `async_generate`, `cache_prefix`, `get_tokenizer`, `shutdown`.

Server options that are also Engine options (shared/config.py: model_path, mem_fraction_static,
context_length, tp_size, ...) are passed through; SGLang's others (port, log_level, ...) are accepted
and ignored, with a debug log naming them, but those that ask for LoRA adapters (`lora_paths`,
`enable_lora`), which ignored would serve the base model instead, raise ValueError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sglbus.lang.backends.base import Backend, resolve_backend

log = logging.getLogger(__name__)

# SGLang's names for values of options we also have
_VALUE_ALIASES = {
    "dtype": {"half": "float16", "float": "float32"},
    "attention_backend": {"torch_native": "torch"},
}


def engine_options(server_args: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The Engine's options among SGLang server arguments (values in SGLang's spelling translated), and
    the names of the others."""
    from shared.config import EngineConfig

    ours = {f.name for f in dataclasses.fields(EngineConfig)}
    options = {k: _alias(k, v) for k, v in server_args.items() if k in ours}
    return options, sorted(k for k in server_args if k not in ours)


# SGLang server options that ask for LoRA adapters (its other LoRA settings, such as
# max_loras_per_batch, only size what adapters would get, and are ignored like any unknown option)
_ADAPTER_OPTIONS = ("enable_lora", "lora_paths")


def _alias(name: str, value: Any) -> Any:
    return _VALUE_ALIASES.get(name, {}).get(value, value) if isinstance(value, str) else value


class Runtime:
    def __init__(self, log_level: str = "error", launch_timeout: float = 300.0, **server_args: Any) -> None:
        """log_level, launch_timeout (there is no server to wait for) and the server options sglbus does
        not have are ignored (see the module's docstring); an option we have with a value we do not
        support raises ValueError naming it, and so does an option asking for LoRA adapters."""
        from sglbus.engine import Engine

        lora = sorted(k for k in _ADAPTER_OPTIONS if server_args.get(k))
        if lora:  # ignoring these would serve the base model where an adapter was asked for
            raise ValueError(f"sgl.Runtime: {', '.join(lora)}: LoRA adapters are not supported")
        options, ignored = engine_options(server_args)
        if ignored:
            log.debug(
                "sgl.Runtime: ignored SGLang server options sglbus does not have: %s", ", ".join(ignored)
            )
        self.engine = Engine(**options)
        self.endpoint: Backend = resolve_backend(self.engine)

    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | None = None,
                 return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None,
                 lora_path: list[str | None] | None = None) -> str:  # fmt: skip
        """`/generate`'s response as a JSON string, as SGLang's Runtime.generate returns it."""
        paths = [lora_path] if isinstance(lora_path, str) else (lora_path or [])
        if any(p is not None for p in paths):
            raise ValueError("Runtime.generate: lora_path: LoRA adapters are not supported")
        out = self.engine.generate(
            prompt,
            sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return json.dumps(out)

    async def async_generate(
        self, prompt: str, sampling_params: dict[str, Any] | None = None
    ) -> AsyncIterator[str]:
        """The generated text piece by piece (SGLang's Runtime.async_generate / add_request)."""
        loop = asyncio.get_running_loop()
        chunks = self.engine.generate(prompt, sampling_params, stream=True)
        end, pos = object(), 0
        while (chunk := await loop.run_in_executor(None, next, chunks, end)) is not end:
            text = chunk["text"]
            if len(text) > pos:
                yield text[pos:]
                pos = len(text)

    add_request = async_generate

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        self.engine.shutdown()
