"""Loads the weights, sizes and owns the KV memory, runs one forward plus sampling per step."""

from __future__ import annotations

import logging
import time

import psutil
import torch

from services.scheduler.attention.base import AttentionBackend
from services.scheduler.attention.torch_backend import TorchAttention
from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.models.llama import LlamaForCausalLM
from services.scheduler.sampling.sampler import SamplingInfo, sample
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.model_files import iter_weights

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# on CPU, the default share of available RAM for the KV pool
_CPU_KV_FRACTION = 0.15
_GPU_MEM_FRACTION = 0.85
_CPU_MAX_DEFAULT_TOKENS = 1 << 17


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_folder: str) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = mc = ModelConfig.from_folder(model_folder)
        ctx = config.context_length or mc.max_position_embeddings
        if mc.sliding_window:  # no sliding-window attention yet: stay where it equals full attention
            ctx = min(ctx, mc.sliding_window)
        self.context_len = ctx

        t0 = time.perf_counter()
        torch.manual_seed(config.random_seed)
        with torch.device(self.device):
            model = LlamaForCausalLM(mc, ctx)
        model = model.to(self.dtype)
        if config.load_format == "dummy":
            model.init_dummy(config.random_seed)
        else:
            model.load_weights(iter_weights(model_folder))
        self.model = model.eval()
        log.info("loaded %s in %.1f s", model_folder, time.perf_counter() - t0)

        self.max_total_tokens = self._pool_size(config)
        self.max_running_requests = config.max_running_requests or (256 if self.device.type == "cuda" else 64)
        self.kv = KVPool(mc, self.max_total_tokens, self.dtype, self.device)
        self.req_to_token = ReqToTokenPool(self.max_running_requests + 8, ctx + 1, self.device)
        self.attn: AttentionBackend = TorchAttention(self.kv, self.req_to_token, mc.num_heads, mc.head_dim)

    def _pool_size(self, config: EngineConfig) -> int:
        if config.max_total_tokens:
            return config.max_total_tokens
        per_token = self.model_config.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_elsewhere = total - free
            budget = total * (config.mem_fraction_static or _GPU_MEM_FRACTION) - used_elsewhere
            return max(int(budget // per_token), 16)
        budget = psutil.virtual_memory().available * (config.mem_fraction_static or _CPU_KV_FRACTION)
        return max(min(int(budget // per_token), _CPU_MAX_DEFAULT_TOKENS), 16)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [len(fb.logits_idx), vocab]."""
        self.attn.prepare(fb)
        return self.model(fb, self.attn)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingInfo, output_lens: list[int]) -> torch.Tensor:
        positions = torch.tensor(output_lens, dtype=torch.int64, device=logits.device).unsqueeze(1)
        return sample(logits, info, positions)
