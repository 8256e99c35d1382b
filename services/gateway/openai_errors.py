"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, with the status codes OpenAI
uses (400 for a bad request, 401 without the API key, 404 for an unknown model, 503 when nothing can
serve it)."""

from __future__ import annotations

from typing import Any


class OpenAIError(ValueError):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def server_error(message: str, status: int = 500) -> OpenAIError:
    if status == 429:
        kind = "rate_limit_error"
    elif status >= 500:
        kind = "service_unavailable_error" if status == 503 else "server_error"
    else:
        kind = "invalid_request_error"
    return OpenAIError(message, None, status, kind)
