"""Model families by `architectures[0]` of config.json. `shared.model_config.SUPPORTED_ARCHITECTURES`
lists the names (the gateway checks a model without importing torch models); this maps them to the
class that runs them, built as `cls(config, max_positions, dtype)` (its parameters made in dtype).

Every family is a `decoder.CausalLM` subclass: an `Arch` read from its config (what its layers are)
and the names of its checkpoint's tensors; the layers themselves are shared (`layers.py`, `moe.py`).
How to add one: docs/architecture.md, "Model families"."""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.models.decoder import CausalLM
from services.scheduler.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from services.scheduler.models.llama import LlamaForCausalLM
from services.scheduler.models.llava import llava_class
from services.scheduler.models.llava_next import llava_next_class
from services.scheduler.models.mistral import MistralForCausalLM, MixtralForCausalLM
from services.scheduler.models.phi3 import Phi3ForCausalLM
from services.scheduler.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from shared.model_config import SUPPORTED_ARCHITECTURES, VISION_ARCHITECTURES, ModelConfig

MODELS: dict[str, type[CausalLM]] = {
    cls.__name__: cls
    for cls in (
        LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
        Qwen3MoeForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
    )
}  # fmt: skip
# a vision-language architecture -> the wrapper that adds its vision half to its language model's family
VISION_WRAPPERS: dict[str, Callable[[type[CausalLM]], type[CausalLM]]] = {
    "LlavaForConditionalGeneration": llava_class,
    "LlavaNextForConditionalGeneration": llava_next_class,
}
assert set(MODELS) | VISION_ARCHITECTURES == set(SUPPORTED_ARCHITECTURES)
assert set(VISION_WRAPPERS) == VISION_ARCHITECTURES


def model_class(config: ModelConfig | str) -> type[CausalLM]:
    """The class that runs a model: by its architecture; a vision-language model (config.vision) wraps
    the family of its language model (models/llava.py, llava_next.py)."""
    if isinstance(config, ModelConfig) and config.vision is not None:
        return VISION_WRAPPERS[config.architecture](model_class(config.raw["architectures"][0]))
    architecture = config if isinstance(config, str) else config.architecture
    if architecture not in MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODELS)}")
    return MODELS[architecture]
