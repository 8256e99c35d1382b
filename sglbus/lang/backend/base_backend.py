"""`from sglang.lang.backend.base_backend import BaseBackend`, as sglbus (our `Backend`)."""

from sglbus.lang.backends.base import Backend as BaseBackend

__all__ = ["BaseBackend"]
