"""Engine and scheduler configuration: one frozen dataclass; "auto" values are resolved before freezing.

Every option can also come from the environment as `SGLBUS_<NAME>` (upper case); `from_env` is the one
place that reads it. Explicit keyword arguments win over the environment. Each field is declared with
`option(default, help, choices)`: its description and allowed values live there once, and `add_cli_args`
turns them into `--help` text and argparse choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")

POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
MOE_RUNNER_BACKENDS = ("auto", "torch", "triton")  # services/scheduler/models/moe.py
GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance")


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    """A config field with its description and allowed values; `secret` keeps it out of repr (logs)."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta, repr=not secret)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = option(
        None, "Hugging Face folder or .gguf file; unset: the default model (SmolLM2-135M-Instruct)"
    )
    tokenizer_path: str | None = option(None, "tokenizer folder; unset: the model folder")
    load_format: str = option(
        "auto",
        "dummy: random weights from the model's config.json (benchmarks of large shapes)",
        LOAD_FORMATS,
    )
    dtype: str = option("auto", "weight and KV dtype; auto: float32 on CPU, bfloat16 on GPU", DTYPES)
    device: str = option("auto", "cpu, cuda, cuda:N; auto: cuda when available")
    tp_size: int = option(
        1,
        "tensor parallelism: the model split over this many ranks, one device each (on CUDA the GPUs "
        "from this worker's device on: cuda:N .. cuda:N+tp_size-1; on CPU, processes)",
    )
    context_length: int | None = option(
        None, "longest prompt + output; unset: the model's max_position_embeddings"
    )
    max_total_tokens: int | None = option(None, "KV pool size in tokens; unset: sized by mem_fraction_static")
    mem_fraction_static: float | None = option(
        None, "share of device memory (GPU: total; CPU: available RAM) for weights + KV pool, in (0, 1)"
    )
    max_running_requests: int | None = option(
        None, "requests decoded at once; unset: sized from the KV pool on GPU (at most 4096), 64 on CPU"
    )
    max_queued_requests: int | None = option(
        16384,
        "requests a scheduler queues for admission at most; past it a new request is refused with a 503 "
        "(and routers send none)",
    )
    chunked_prefill_size: int | None = option(
        None, "prefill tokens per step, longer prompts are split into chunks; unset: 8192 on GPU, 2048 on CPU"
    )
    schedule_policy: str = option("lpm", "order in which waiting requests are admitted", POLICIES)
    disable_radix_cache: bool = option(False, "turn the prefix cache off (for comparison)")
    new_token_ratio: float = option(
        0.4, "share of the remaining output budget of running requests kept free when admitting new ones"
    )
    max_queue_wait: float = option(
        30.0, "seconds; a waiting request older than this is admitted first whatever the policy"
    )
    attention_backend: str = option(
        "auto", "attention implementation; auto: triton on GPU, torch on CPU", ATTENTION_BACKENDS
    )
    moe_runner_backend: str = option(
        "auto",
        "how a mixture-of-experts layer runs its experts; auto: the fused Triton kernel with the "
        "triton attention backend, a torch loop over the experts otherwise",
        MOE_RUNNER_BACKENDS,
    )
    cuda_graph_max_bs: int = option(
        4096, "largest decode batch replayed from a CUDA graph (GPU only; never above max_running_requests)"
    )
    disable_cuda_graph: bool = option(False, "run every decode step eagerly (GPU only; for comparison)")
    disable_overlap_schedule: bool | None = option(
        None, "prepare each step while the previous one runs on the GPU; unset: overlap on GPU, not on CPU"
    )
    enable_cascade_attention: bool = option(
        False,
        "decode many requests over one long cached prefix with the shared-prefix kernel "
        "(triton backend; eager steps; slower than without it on an H200 so far)",
    )
    disable_jump_forward: bool = option(
        False, "decode a grammar's forced continuations one token per step (for comparison)"
    )
    grammar_backend: str = option(
        "auto",
        "library of regex / json_schema / ebnf decoding; auto: xgrammar when installed, else llguidance",
        GRAMMAR_BACKENDS,
    )
    grammar_compile_timeout: float = option(
        10.0, "seconds; a regex / json_schema / ebnf that takes longer to compile ends its request (400)"
    )
    random_seed: int = option(0, "sampling seed")
    subject_prefix: str = option("sglbus", "NATS subject prefix (one per model deployment)")
    worker_id: str = option("0", "this scheduler's id; its detokenizer must have the same")
    request_ack_wait: float = option(
        30.0, "seconds; a request its scheduler stopped keeping alive is delivered again to another one"
    )
    gateway_timeout: float = option(
        10.0,
        "seconds; a gateway whose heartbeat stopped this long is gone (its clients with it): schedulers "
        "drop its requests. Not counted while the scheduler or the bus itself stalled",
    )

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check_choices(self)
        need(self.chunked_prefill_size is None or self.chunked_prefill_size >= 1, "chunked_prefill_size >= 1")
        need(self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs must be >= 1")
        need(self.tp_size >= 1, "tp_size must be >= 1")
        need(self.max_total_tokens is None or self.max_total_tokens >= 2, "max_total_tokens must be >= 2")
        need(
            self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
            "mem_fraction_static must be in (0, 1)",
        )
        need(self.max_running_requests is None or self.max_running_requests >= 1, "max_running_requests >= 1")
        need(self.max_queued_requests is None or self.max_queued_requests >= 1, "max_queued_requests >= 1")
        need(
            is_subject_token(self.worker_id),
            "worker_id must be a NATS subject token: no dots, spaces, * or >",
        )
        need(0 <= self.new_token_ratio <= 1, "new_token_ratio must be in [0, 1]")
        need(self.request_ack_wait > 0, "request_ack_wait must be > 0")
        need(self.gateway_timeout > 0, "gateway_timeout must be > 0")

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        return from_env(cls, **overrides)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def is_subject_token(name: str) -> bool:
    """One token of a NATS subject (a worker id names its work-queue lane and event subjects)."""
    return bool(name) and not any(c in ".*>" or c.isspace() for c in name)


def check_choices(cfg: Any) -> None:
    """ValueError naming the field when a value is not one of its declared choices."""
    for f in fields(cfg):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(cfg, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {choices}, not {getattr(cfg, f.name)!r}")


def from_env(cls: type[T], **overrides: Any) -> T:
    """Build a config dataclass: `SGLBUS_<FIELD>` environment variables, then explicit overrides."""
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(unknown)}; known: {', '.join(names)}")
    values: dict[str, Any] = {}
    for name, f in names.items():
        raw = os.environ.get(env_name(name))
        if raw is not None:
            try:
                values[name] = _parse(raw, f.type)
            except ValueError:
                raise ValueError(f"{env_name(name)}={raw!r} is not a valid {f.type}") from None
    values.update(overrides)
    return cls(**values)


def env_name(field_name: str) -> str:
    return f"SGLBUS_{field_name.upper()}"


def help_text(f: dataclasses.Field) -> str:
    """The field's description, default and environment variable, for `--help` (argparse-escaped)."""
    default = (
        "unset" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else f.default
    )
    text = f"{f.metadata.get('help', '')} (default: {default}; env {env_name(f.name)})"
    return text.replace("%", "%%")


def add_cli_args(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """One `--field-name` flag per dataclass field (or those in `only`), described by the field's
    metadata; unset flags leave the environment/default in charge."""
    group = parser.add_argument_group(cls.__name__)
    for f in fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        if t.startswith("bool"):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text(f))  # fmt: skip
        else:
            group.add_argument(flag, dest=f.name, default=None, type=_cli_type(t),
                               choices=f.metadata.get("choices"), help=help_text(f))  # fmt: skip


def _cli_type(type_name: str) -> Any:
    def parse(raw: str) -> Any:
        return _parse(raw, type_name)

    parse.__name__ = type_name.split(" ")[0]  # argparse says "invalid int value: 'x'"
    return parse


def cli_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}


def _parse(raw: str, type_name: Any) -> Any:
    t = str(type_name)
    if t.startswith("bool"):
        return raw.lower() in ("1", "true", "yes", "on")
    if t.startswith("int"):
        return int(raw)
    if t.startswith("float"):
        return float(raw)
    return None if raw.lower() in ("", "none", "null") else raw
