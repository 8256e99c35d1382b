"""sglbus: SGLang's feature set as asyncio services over NATS. `sglbus.Engine` runs it offline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]

if TYPE_CHECKING:
    from sglbus.engine import Engine


def __getattr__(name: str) -> Any:
    # lazy, so `import sglbus` stays cheap (torch loads only when an Engine is made)
    if name == "Engine":
        from sglbus.engine import Engine

        return Engine
    raise AttributeError(name)
