"""Engine and scheduler configuration: one frozen dataclass; "auto" values are resolved before freezing.

Every option can also come from the environment as `SGLBUS_<NAME>` (upper case); `from_env` is the one
place that reads it. Explicit keyword arguments win over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, TypeVar

T = TypeVar("T")

POLICIES = ("lpm", "dfs-weight", "fcfs")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch",)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # HF folder or .gguf file; None: the default model (SmolLM2-135M-Instruct)
    tokenizer_path: str | None = None  # defaults to the model folder
    load_format: str = "auto"  # "dummy": random weights from the model's config.json
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available
    context_length: int | None = None  # defaults to the model's max_position_embeddings
    # KV pool size in tokens; when None it is sized by mem_fraction_static
    max_total_tokens: int | None = None
    # share of device memory (GPU: total; CPU: available RAM) for weights + KV pool
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None  # auto: 256 on GPU, 64 on CPU
    chunked_prefill_size: int = 2048  # prefill tokens per step; longer prompts are split into chunks
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    # share of the remaining output budget of running requests kept free when admitting new ones
    new_token_ratio: float = 0.4
    # a waiting request older than this (seconds) is admitted first whatever the policy (no starvation)
    max_queue_wait: float = 30.0
    attention_backend: str = "torch"
    random_seed: int = 0
    subject_prefix: str = "sglbus"
    worker_id: str = "0"

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.schedule_policy in POLICIES, f"schedule_policy must be one of {POLICIES}")
        need(self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
        need(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}",
        )
        need(self.chunked_prefill_size >= 1, "chunked_prefill_size must be >= 1")
        need(self.max_total_tokens is None or self.max_total_tokens >= 2, "max_total_tokens must be >= 2")
        need(
            self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
            "mem_fraction_static must be in (0, 1)",
        )
        need(self.max_running_requests is None or self.max_running_requests >= 1, "max_running_requests >= 1")
        need(0 <= self.new_token_ratio <= 1, "new_token_ratio must be in [0, 1]")

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        return from_env(cls, **overrides)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def from_env(cls: type[T], **overrides: Any) -> T:
    """Build a config dataclass: `SGLBUS_<FIELD>` environment variables, then explicit overrides."""
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(unknown)}; known: {', '.join(names)}")
    values: dict[str, Any] = {}
    for name, f in names.items():
        raw = os.environ.get(f"SGLBUS_{name.upper()}")
        if raw is not None:
            values[name] = _parse(raw, f.type)
    values.update(overrides)
    return cls(**values)


def add_cli_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--field-name` flag per dataclass field; unset flags leave the environment/default in charge."""
    group = parser.add_argument_group(cls.__name__)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        if t.startswith("bool"):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, dest=f.name, default=None, type=lambda raw, t=t: _parse(raw, t),
                               help=f"default: {f.default!r}")  # fmt: skip


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
