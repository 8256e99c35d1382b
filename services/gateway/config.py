"""Gateway configuration (also from `SGLBUS_<NAME>` environment variables)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    nats_url: str = "nats://127.0.0.1:4222"
    subject_prefix: str = "sglbus"
    model_path: str | None = None  # for the tokenizer and /get_model_info; default model when unset
    tokenizer_path: str | None = None
    gateway_id: str | None = None  # names this gateway's output subject; random when unset
    max_body_bytes: int = 32 * 1024 * 1024
    # in-flight requests fail when no scheduler or detokenizer heartbeat arrived for this long
    worker_timeout: float = 5.0
    health_generate_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.worker_timeout <= 0:
            raise ValueError("worker_timeout must be > 0")
