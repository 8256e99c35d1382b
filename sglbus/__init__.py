"""sglbus: SGLang's feature set as asyncio services over NATS. `sglbus.Engine` runs it offline;
`import sglbus as sgl` is also the frontend language (`sgl.function`, `sgl.gen`, ..., see sglbus.lang)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# the frontend language's public names, loaded on first use (sglbus.lang needs no torch either)
_LANG = (
    "Backend", "BusEndpoint", "ChatTemplate", "ChoiceDecision", "ChoiceMethod", "EngineBackend", "ForkGroup",
    "Function", "GlobalConfig", "OpenAI", "ProgramState", "Runtime", "RuntimeEndpoint", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_chat_template", "get_default_backend", "get_server_info", "global_config", "greedy_token_selection",
    "image", "select", "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
    "video",
)  # fmt: skip
__all__ = ["Engine", "__version__", *_LANG]

if TYPE_CHECKING:
    from sglbus.engine import Engine
    from sglbus.lang import *  # noqa: F403


def __getattr__(name: str) -> Any:
    # lazy, so `import sglbus` stays cheap (torch loads only when an Engine is made)
    if name == "Engine":
        from sglbus.engine import Engine

        return Engine
    if name in _LANG:
        import sglbus.lang

        return getattr(sglbus.lang, name)
    raise AttributeError(f"module 'sglbus' has no attribute {name!r}")
