"""Shared fixtures: the default model folder, the HF transformers reference, and engines that are
checked for leaked KV slots when each test ends."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
# without a GPU, Triton kernels (sglbus_kernels/, the triton attention backend) run in Triton's interpreter;
# it is read when a kernel module is imported, so it is set before any test module loads
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:  # the kernel tests skip
        pass
    else:
        from triton_interpreter import patch

        patch()


@pytest.fixture(scope="session")
def model_folder() -> str:
    from shared.model_files import resolve_model_folder

    return resolve_model_folder(None)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own Llama on the same GGUF weights, fp32: the reference for parity tests."""
    from transformers import AutoModelForCausalLM

    from shared.model_files import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # ignore_eos: keep generating after an EOS
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def engine():
    """One default-model Engine shared by a test module; integrity-checked and shut down after it."""
    from sglbus import Engine

    e = Engine()
    yield e
    e.check_integrity()
    e.shutdown()


@pytest.fixture
def make_engine():
    """make_engine(**options) -> Engine on the default model; integrity-checked and shut down after."""
    from sglbus import Engine

    engines = []

    def make(**options):
        engine = Engine(**options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        try:
            engine.check_integrity()
        finally:
            engine.shutdown()


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors, so outputs the kernels allocate start poisoned."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)
