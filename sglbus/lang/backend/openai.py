"""`from sglang.lang.backend.openai import OpenAI`, as sglbus."""

from sglbus.lang.backends.openai import OpenAI

__all__ = ["OpenAI"]
