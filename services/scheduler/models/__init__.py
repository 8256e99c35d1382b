"""Model families by `architectures[0]` of config.json. `shared.model_config.SUPPORTED_ARCHITECTURES`
lists the names (the gateway checks a model without importing torch models); this maps them to the
class that runs them, built as `cls(config, max_positions, dtype)` (its parameters made in dtype)."""

from __future__ import annotations

from torch import nn

from services.scheduler.models.llama import LlamaForCausalLM
from shared.model_config import SUPPORTED_ARCHITECTURES

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # the same layers; sliding window capped in the runner
}
assert set(MODELS) == set(SUPPORTED_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    return MODELS[architecture]
