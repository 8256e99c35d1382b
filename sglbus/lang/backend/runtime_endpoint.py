"""`from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint`, as sglbus."""

from sglbus.lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["RuntimeEndpoint"]
