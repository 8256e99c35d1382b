"""Loads the weights, sizes and owns the KV memory, runs one forward plus sampling per step.

On CUDA the KV pool takes what `mem_fraction_static` leaves after the weights (as SGLang sizes it),
the pool decides how many requests run at once, and decode steps replay CUDA graphs
(`cuda_graph.py`) when the attention backend can be captured; a warm-up runs each kind of step once
before the first request (`warmup.py`). With `tp_size` N > 1 this process is rank 0 of N: it starts
the other ranks (services/scheduler/parallel/followers.py), each builds a runner of its own (its share
of the weights and KV heads, the same pool size and graphs), and `forward` sends each step to them
before running its own share. The CUDA caching allocator uses
expandable segments unless PYTORCH_CUDA_ALLOC_CONF says otherwise: eager steps of 500-2,000 requests
allocate logits and activations of a new size every step, and growing the cache by cudaMalloc
left the H200 idle ~8 s of a 50 s run where expandable segments left ~4.5 s (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import psutil
import torch

from services.scheduler.attention import create_backend, resolve_backend_name
from services.scheduler.attention.base import AttentionBackend
from services.scheduler.forward_batch import ForwardBatch, LogitsOutput
from services.scheduler.images import Vision
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.models import model_class
from services.scheduler.models.ops import make_ops
from services.scheduler.parallel.followers import Followers
from services.scheduler.parallel.group import SINGLE_RANK, TensorParallel, free_port
from services.scheduler.parallel.shard import check_heads
from services.scheduler.sampling.sampler import SamplingInfo, sample
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.model_files import iter_weight_slices

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# on CPU, the default share of available RAM for the KV pool
_CPU_KV_FRACTION = 0.15
_GPU_MEM_FRACTION = 0.85
_CPU_MAX_DEFAULT_TOKENS = 1 << 17
_CPU_MAX_RUNNING = 64
_GPU_MAX_RUNNING = 4096


def _build_model(
    cls: type,
    mc: ModelConfig,
    ctx: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel = SINGLE_RANK,
) -> torch.nn.Module:
    """The model with its parameters allocated on `device` in `dtype` from the start: built in float32
    and cast, an 8B model took 32 GB more at its peak, and the cast left that much in the CUDA
    allocator's cache, which the KV pool's sizing counted as used (~600k tokens on an H200 instead of
    ~850k). The dtype is an argument, not the process's default dtype, which other threads share."""
    with torch.device(device):
        return cls(mc, ctx, dtype, tp)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a tensor-parallel worker on CUDA uses the r-th GPU from the worker's device."""
    if device.type != "cuda" or rank == 0:
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_folder: str, rank: int = 0, port: int = 0) -> None:
        """rank, port: a tensor-parallel follower's rank and its group's port (rank 0 picks them)."""
        self.followers: Followers | None = None  # set once this runner is ready (warm-up runs alone)
        base, size = resolve_device(config.device), config.tp_size
        if base.type == "cuda" and (base.index or 0) + size > torch.cuda.device_count():
            last = torch.device("cuda", (base.index or 0) + size - 1)
            raise ValueError(f"tp_size {size} from {base} needs {last}, but this machine has "
                             f"{torch.cuda.device_count()} GPU(s)")  # fmt: skip
        self.device = rank_device(base, rank)
        if self.device.type == "cuda":
            # read when the allocator starts, at the process's first CUDA allocation (normally below)
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_folder = model_folder
        self.model_config = mc = ModelConfig.from_folder(model_folder)
        followers = None
        self.tp = SINGLE_RANK
        if size > 1:
            check_heads(mc.num_heads, mc.num_kv_heads, size)
            if self.device.type == "cpu":  # the ranks share the cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            if rank == 0:
                port = free_port()
                followers = Followers(config, model_folder, port)
        try:
            if size > 1:
                self.tp = TensorParallel.start(rank, size, port, self.device)
            self._build(config, followers)
        except BaseException:
            if followers is not None:  # they may wait in a collective this rank never reaches
                followers.close(wait=False)
            self.tp.close()
            raise
        self.followers = followers  # from here on, each forward goes to them too

    def _build(self, config: EngineConfig, followers: Followers | None) -> None:
        """The model, KV pool, attention backend, CUDA graphs and warm-up (each rank its own share)."""
        mc = self.model_config
        heads = self.tp.shard.heads(mc.num_heads, mc.num_kv_heads)
        # this rank's share of the heads: its KV pool and attention backend see only those
        self.local_config = dataclasses.replace(mc, num_heads=heads.q_count, num_kv_heads=heads.kv_count)
        ctx = config.context_length or mc.max_position_embeddings
        self.context_len = ctx
        self.backend_name = resolve_backend_name(config.attention_backend, self.device)

        t0 = time.perf_counter()
        torch.manual_seed(config.random_seed)
        model = _build_model(model_class(mc), mc, ctx, self.device, self.dtype, self.tp)
        if config.load_format == "dummy":
            model.init_dummy(config.random_seed + self.tp.rank)
        else:
            model.load_weights(iter_weight_slices(self.model_folder))
        model.set_ops(make_ops(self.backend_name, config.moe_runner_backend))
        self.model = model.eval()
        self.vision: Vision | None = None  # a vision-language model's image handling (images.py)
        if mc.vision is not None:
            self.vision = Vision.of(model, self.model_folder)
        log.info("loaded %s in %.1f s", self.model_folder, time.perf_counter() - t0)

        if self.device.type == "cuda":
            # what the loading left in the allocator's cache is free for the pool: the sizing below
            # reads the driver's free memory, which counts cached blocks as used
            torch.cuda.empty_cache()
        self.max_total_tokens = self.tp.min(self._pool_size(config), self.device)  # the smallest rank's
        self.max_running_requests = config.max_running_requests or self._default_max_running()
        self.chunked_prefill_size = config.chunked_prefill_size or (
            8192 if self.device.type == "cuda" else 2048
        )
        # overlap scheduling pays where the device runs asynchronously; on a CPU it would only delay
        # each step's output by one step (disable_overlap_schedule=False forces it, as tests do)
        disable = config.disable_overlap_schedule
        self.overlap_schedule = self.device.type == "cuda" if disable is None else not disable
        self.kv = KVPool(self.local_config, self.max_total_tokens, self.dtype, self.device)
        journal = followers is not None  # rank 0 sends its req_to_token writes to the others
        self.req_to_token = ReqToTokenPool(self.max_running_requests + 8, ctx + 1, self.device, journal)
        self.attn: AttentionBackend = create_backend(
            self.backend_name, self.kv, self.req_to_token, heads.q_count, mc.head_dim
        )
        self.graphs = None
        graphs = self.attn.supports_cuda_graph and model.capturable and not config.disable_cuda_graph
        if self.device.type == "cuda" and graphs:
            from services.scheduler.cuda_graph import CudaGraphRunner

            t0 = time.perf_counter()
            max_bs = min(config.cuda_graph_max_bs, self.max_running_requests)
            self.graphs = CudaGraphRunner(self.model, self.attn, self.req_to_token, max_bs)
            log.info("captured %d CUDA graphs (decode batches up to %d) in %.1f s",
                     len(self.graphs.buckets), max_bs, time.perf_counter() - t0)  # fmt: skip
        # steps of short extends run as one-token rows of a decode graph (StepInputs.as_rows); 0: never
        self.rows_max_tokens = self.graphs.max_bs if self.graphs is not None else 0
        if self.device.type == "cuda":
            from services.scheduler.warmup import warm_up

            log.info("warm-up steps (kernel compilation) took %.1f s", warm_up(self))
        log.info("KV pool %d tokens, %d running requests at most, attention %s",
                 self.max_total_tokens, self.max_running_requests, self.backend_name)  # fmt: skip

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (nothing with one rank)."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None
        self.tp.close()

    def _pool_size(self, config: EngineConfig) -> int:
        if config.max_total_tokens:
            return config.max_total_tokens
        per_token = self.local_config.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = config.mem_fraction_static or _GPU_MEM_FRACTION
            tokens = int((total * fraction - (total - free)) // per_token)
            if tokens < self.context_len + 1:  # not even one full-length request: say so, do not limp on
                gib = 2**30
                raise RuntimeError(
                    f"no room for the KV pool on {self.device}: {free / gib:.1f} of {total / gib:.1f} GiB "
                    f"free after the weights, mem_fraction_static {fraction} leaves {max(tokens, 0)} tokens; "
                    "raise mem_fraction_static, free the GPU, or set max_total_tokens"
                )
            return tokens
        budget = psutil.virtual_memory().available * (config.mem_fraction_static or _CPU_KV_FRACTION)
        # the ranks of a CPU worker share the RAM: the budget holds every rank's KV heads of a token
        per_token = self.model_config.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8
        return max(min(int(budget // per_token), _CPU_MAX_DEFAULT_TOKENS), 16)

    def _default_max_running(self) -> int:
        if self.device.type != "cuda":
            return _CPU_MAX_RUNNING
        # SGLang's rule: room for 512 full-context requests' worth per context of pool, 2048..4096
        by_pool = self.max_total_tokens * 512 // self.context_len
        return min(max(by_pool, 2048), _GPU_MAX_RUNNING)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        if self.followers is not None:
            self.followers.forward(fb, self.req_to_token.take_journal(), self)
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.replay(fb)
        self.attn.prepare(fb)
        return self.model(fb, self.attn)

    @torch.inference_mode()
    def image_rows(self, tiles: list[torch.Tensor], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Pictures' normalised tiles [T, 3, S, S] and sizes as sent -> their rows [tokens, hidden] (on
        this rank: the rows reach the other ranks with the step, ForwardBatch.mm)."""
        return self.model.image_rows(tiles, sizes)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states -> logits (prompt logprobs): on every rank under tensor parallelism."""
        if self.followers is not None:
            self.followers.logits(hidden, self)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, info: SamplingInfo, output_lens: torch.Tensor, check: bool = True
    ) -> torch.Tensor:
        """output_lens [B, 1] int64 on the logits' device: each row's output index (keys seeded noise);
        check: see sampler.sample."""
        return sample(logits, info, output_lens, check)
