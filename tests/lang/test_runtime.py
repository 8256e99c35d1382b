"""sgl.Runtime: SGLang's server options mapped onto the Engine's (shared/config.py), the rest ignored,
and the Runtime used as SGLang's programs use it. The Engine is a stand-in here (no model); the real one
is the same class the backend already wraps (tests/lang/test_interpreter_engine.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

import sglbus as sgl
import sglbus.engine
from sglbus.lang.backends.engine import EngineBackend
from sglbus.lang.runtime import engine_options
from shared.config import EngineConfig


class FakeEngine:
    """What Runtime and EngineBackend use of an Engine; its options are checked by the real config."""

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        self.config = EngineConfig(model_path=model_path, **options)
        self.options = {"model_path": model_path, **options}
        self.tokenizer = SimpleNamespace(chat_template=None, bos_token="", eos_token="")
        self.requests: list[dict[str, Any]] = []
        self.closed = False

    def generate(
        self, text: Any = None, sampling_params: Any = None, stream: bool = False, **fields: Any
    ) -> Any:
        self.requests.append({"text": text, "sampling_params": sampling_params, **fields})
        if stream:
            return iter([{"text": " Par", "meta_info": {}}, {"text": " Paris", "meta_info": {}}])
        return {"text": " Paris", "meta_info": {"finish_reason": {"type": "stop"}, "prompt_tokens": 5}}

    def flush_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(sglbus.engine, "Engine", FakeEngine)
    yield
    sgl.global_config.default_backend = None


def test_server_options_we_have_pass_through_in_our_spelling():
    options, ignored = engine_options(
        {"model_path": "m", "tp_size": 2, "port": 30000, "mem_fraction_static": 0.5, "dtype": "half",
         "attention_backend": "torch_native", "trust_remote_code": True, "context_length": 512}
    )  # fmt: skip
    assert options == {"model_path": "m", "tp_size": 2, "mem_fraction_static": 0.5, "dtype": "float16",
                       "attention_backend": "torch", "context_length": 512}  # fmt: skip
    assert ignored == ["port", "trust_remote_code"]


def test_runtime_runs_the_engine_and_logs_what_it_ignored(fake_engine, caplog):
    with caplog.at_level(logging.DEBUG, logger="sglbus.lang.runtime"):
        runtime = sgl.Runtime(model_path="m", port=30000, log_level="info", mem_fraction_static=0.3)
    assert runtime.engine.options == {"model_path": "m", "mem_fraction_static": 0.3}
    assert "ignored SGLang server options sglbus does not have: port" in caplog.text
    assert isinstance(runtime.endpoint, EngineBackend) and runtime.endpoint.engine is runtime.engine
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        sgl.Runtime(attention_backend="flashinfer")  # one of ours, with a value we do not have


def test_runtime_is_a_backend_as_in_sglangs_programs(fake_engine):
    runtime = sgl.Runtime(model_path="m")
    sgl.set_default_backend(runtime)
    assert sgl.global_config.default_backend is runtime.endpoint

    @sgl.function
    def qa(s):
        s += "The capital of France is" + sgl.gen("answer", max_tokens=4)

    assert qa.run()["answer"] == " Paris"
    assert qa.run(backend=runtime)["answer"] == " Paris"
    assert sgl.flush_cache(runtime) is True
    runtime.shutdown()
    assert runtime.engine.closed


def test_runtime_generate_returns_sglangs_json_string(fake_engine):
    runtime = sgl.Runtime(model_path="m")
    out = runtime.generate("The capital of France is", {"max_new_tokens": 4}, return_logprob=True)
    assert isinstance(out, str) and json.loads(out)["text"] == " Paris"
    assert runtime.engine.requests[-1]["return_logprob"] is True
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        runtime.generate("x", lora_path=["adapter"])
    with pytest.raises(ValueError, match="lora_paths: LoRA adapters are not supported"):
        sgl.Runtime(model_path="m", lora_paths=["adapter"])
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters are not supported"):
        sgl.Runtime(model_path="m", enable_lora=True)
    # LoRA options left off, or settings that load no adapter, are ignored like other unknown options
    sgl.Runtime(model_path="m", enable_lora=False, lora_paths=[], max_loras_per_batch=8).shutdown()
    assert runtime.get_tokenizer() is runtime.engine.tokenizer

    async def pieces() -> list[str]:
        return [p async for p in runtime.async_generate("The capital of France is")]

    assert asyncio.run(pieces()) == [" Par", "is"]
