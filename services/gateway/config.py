"""Gateway configuration (also from `SGLBUS_<NAME>` environment variables)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.gateway.router.policies import ROUTER_POLICIES
from shared.config import option
from shared.reasoning_parser import REASONING_PARSERS


@dataclass(frozen=True)
class GatewayConfig:
    host: str = option("127.0.0.1", "address the HTTP API listens on; 0.0.0.0 for every interface")
    port: int = option(30000, "HTTP port")
    nats_url: str = option("nats://127.0.0.1:4222", "the NATS server")
    subject_prefix: str = option("sglbus", "NATS subject prefix (one per model deployment)")
    model_path: str | None = option(
        None, "for the tokenizer and /get_model_info; unset: the default model (SmolLM2-135M-Instruct)"
    )
    tokenizer_path: str | None = option(None, "tokenizer folder; unset: the model folder")
    served_model_name: str | None = option(
        None,
        "the model's name in /v1/models and in OpenAI requests' `model`; unset: the model file's name",
    )
    reasoning_parser: str | None = option(
        None,
        "the model's reasoning format, as SGLang's: /v1/chat/completions then answers its reasoning in "
        "`reasoning_content` apart from `content` (per request: separate_reasoning, stream_reasoning); "
        "unset: the answer as the model wrote it",
        REASONING_PARSERS,
    )
    gateway_id: str | None = option(
        None, "names this gateway's output subject; unset: random (leave it unset on scaled gateways)"
    )
    reuse_port: bool = option(
        False,
        "share the HTTP port with the other gateways of this host (SO_REUSEPORT: the kernel spreads the "
        "connections); `sglbus serve --tokenizer-worker-num` sets it",
    )
    max_body_bytes: int = option(32 * 1024 * 1024, "largest accepted request body, in bytes")
    max_buffered_bytes: int = option(
        1 << 30,
        "request-body bytes a gateway holds while they arrive, across all connections; past it a body gets "
        "a 503 with Retry-After (each body is bounded by max_body_bytes, many at once by this)",
    )
    allowed_hosts: str | None = option(
        None,
        "on a loopback address, Host names besides localhost / 127.0.0.1 / [::1] the HTTP API answers "
        "(comma-separated; * for any: e.g. behind a reverse proxy that passes its own Host on)",
    )
    max_inflight_per_client: int | None = option(
        None,
        "requests (prompts x n) one client (its address and bearer token) may have in flight at once; past "
        "it its new requests get a 429 with Retry-After while other clients are served (default: no "
        "bound of its own: max_inflight_requests)",
    )
    max_connections: int = option(
        8192, "open HTTP connections at most (each stream holds one); past it new ones get a 503"
    )
    max_request_states: int = option(
        4096,
        "prompts x n one request may ask for (a batch of 4096 prompts, or 32 prompts with n 128); "
        "past it the request gets a 400",
    )
    max_inflight_requests: int = option(
        16384,
        "requests (prompts x n) this gateway has in flight at most; past it a new request gets a 503 "
        "with Retry-After, and the ones in flight go on",
    )
    max_bus_request_bytes: int = option(
        4 * 1024 * 1024, "largest bus-API request, in bytes (the bus is shared: smaller than max_body_bytes)"
    )
    grammar_check_timeout: float = option(
        5.0,
        "seconds a request's regex / json_schema / ebnf may take to check (in a child process, killed past "
        "it); past it the request gets a 400",
    )
    worker_timeout: float = option(
        5.0,
        "seconds without a scheduler or detokenizer heartbeat after which a worker counts as dead (streams "
        "that already sent tokens then fail at once)",
    )
    recovery_timeout: float = option(
        120.0,
        "seconds the other in-flight requests wait for a dead worker to come back (the work queue then "
        "runs them again) before they fail",
    )
    worker_recovery_timeout: float = option(
        10.0,
        "seconds the requests routed to a dead worker wait for it to come back; then they are taken back "
        "from its queue and routed to a live worker (streams that already sent tokens fail at once)",
    )
    router_policy: str = option(
        "cache_aware",
        "which worker runs a request: cache_aware (fewest prefill tokens to wait for: the prompt less what "
        "the worker's prefix cache holds, plus its queue), least_load, round_robin, random, or shared (no "
        "choice: any scheduler takes it off one shared queue)",
        ROUTER_POLICIES,
    )
    router_balance_weight: float = option(
        32.0,
        "cache_aware and least_load: the prefill tokens one running or queued request weighs in a "
        "worker's load (higher spreads requests more evenly, lower keeps more affinity)",
    )
    health_generate_timeout: float = option(
        30.0, "seconds allowed for the 1-token generation of /health_generate"
    )
    shutdown_timeout: float = option(
        20.0,
        "seconds a SIGTERM / SIGINT lets in-flight requests finish (new ones get a 503 meanwhile); those "
        "still running then end with an error saying so. `sglbus serve` gives its gateways this long",
    )
    api_key: str | None = option(
        None,
        "when set, every HTTP route but /health and /health_generate needs `Authorization: Bearer <key>`; "
        "prefer the environment variable (a command line is visible to other users)",
        secret=True,
    )
    admin_api_key: str | None = option(
        None,
        "when set, /flush_cache needs `Authorization: Bearer <admin key>`, and that key may abort any "
        "client's requests (other callers abort only their own); accepted wherever the API key is",
        secret=True,
    )
    ssl_certfile: str | None = option(
        None, "HTTPS: the certificate file (PEM, with its chain), as SGLang's; with ssl_keyfile. Unset: HTTP"
    )
    ssl_keyfile: str | None = option(None, "HTTPS: the private key file (PEM) of ssl_certfile")
    allowed_media_dir: str | None = option(
        None,
        "vision-language models: the only folder image_data file paths may name (a relative path is "
        "inside it); unset: file paths are refused (base64 and data URLs always work; URLs are never "
        "fetched)",
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both for HTTPS, or neither")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{name} {path!r} is not a readable file")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            allowed = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {allowed}, not {self.reasoning_parser!r}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError("max_buffered_bytes must be >= max_body_bytes (one largest body must fit)")
        if self.max_bus_request_bytes < 1024:
            raise ValueError("max_bus_request_bytes must be >= 1024")
        if self.max_inflight_per_client is not None and self.max_inflight_per_client < 1:
            raise ValueError("max_inflight_per_client must be >= 1")
        if min(self.max_request_states, self.max_inflight_requests, self.max_connections) < 1:
            raise ValueError("max_request_states, max_inflight_requests and max_connections must be >= 1")
        if self.worker_timeout <= 0:
            raise ValueError("worker_timeout must be > 0")
        if self.recovery_timeout <= 0:
            raise ValueError("recovery_timeout must be > 0")
        if self.worker_recovery_timeout <= 0:
            raise ValueError("worker_recovery_timeout must be > 0")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, not {self.router_policy!r}"
            )
        if not self.router_balance_weight >= 0:
            raise ValueError("router_balance_weight must be >= 0")
        if not self.shutdown_timeout >= 0:
            raise ValueError("shutdown_timeout must be >= 0")
        if self.allowed_media_dir is not None and not os.path.isdir(self.allowed_media_dir):
            raise ValueError(f"allowed_media_dir {self.allowed_media_dir!r} is not a folder")
