"""Decode steps replayed from CUDA graphs (`--cuda-graph-max-bs`, `--disable-cuda-graph`).

At start-up the whole decode forward (embedding .. logits) is captured once per bucketed batch size
over static input buffers. A decode batch of B requests copies its tensors into the first B rows,
pads the rest up to the bucket with harmless rows (req_to_token's padding row, sequence length 1,
KV slot 0, which is never handed out) and replays the bucket's graph: one launch instead of hundreds,
and no host work per layer. Extends, batches that want prompt logprobs and batches larger than the
largest bucket run eagerly.

    buckets   1 2 4 8, then every 16: padding rows cost their share of the linear layers (on an H200
              buckets of 128 and 256 past 1024 made graph steps of 1,500-2,400 requests ~4-5% slower
              than eager ones; every 16 past 512 instead of every 64 made the seed workload's decode
              steps 1-1.6% shorter, for ~170 more graphs: docs/benchmarks.md, sixteenth session)
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from services.scheduler.attention.base import AttentionBackend
from services.scheduler.forward_batch import ForwardBatch, ForwardMode, LogitsOutput
from services.scheduler.memory import ReqToTokenPool


def graph_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_bs, 16)]
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, model: nn.Module, attn: AttentionBackend, req_to_token: ReqToTokenPool, max_bs: int):
        self.model, self.attn = model, attn
        self.buckets = graph_buckets(max_bs)
        self.max_bs = max_bs
        device = req_to_token.table.device
        self.pad_row = req_to_token.padding_row

        def zeros() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_cache_loc = zeros(), zeros(), zeros()
        self.req_pool_indices = torch.full((max_bs,), self.pad_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.prefix_lens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.extend_start_loc = torch.arange(max_bs, dtype=torch.int64, device=device)
        attn.init_cuda_graph(max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every graph writes its logits into the first rows of this one buffer: an output per bucket
        # would stay allocated in the graph pool (~22 GB for buckets up to 4096 on a 128k vocabulary)
        vocab = model.config.vocab_size
        self.logits = torch.empty(max_bs, vocab, dtype=model.lm_head.dtype, device=device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                self._capture(bs, pool)

    def _static(self, bs: int) -> ForwardBatch:
        ones = torch.ones(bs, dtype=torch.int64)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs],
            logits_idx=None,
            lp_idx=None,
            seq_lens_cpu=ones,
            extend_lens_cpu=ones,
            max_extend_len=1,
            num_decode=bs,
        )

    def _capture(self, bs: int, pool) -> None:
        fb = self._static(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        out = self.logits[:bs]
        with torch.cuda.stream(stream):
            # warm up once: Triton compiles a kernel variant at its first call, cuBLAS allocates its
            # workspace; neither may happen inside a capture
            self.attn.prepare(fb)
            self.model(fb, self.attn, out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (another Engine in this process, idle integrity
        # checks) does not invalidate this capture; "global" failed a second Engine's start-up
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.attn.prepare(fb)
            self.model(fb, self.attn, out)
        self.graphs[bs] = graph

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.mode is ForwardMode.DECODE
            and fb.lp_idx is None
            and fb.cascade is None
            and fb.mm is None
            and fb.batch_size <= self.max_bs
        )

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        bs = fb.batch_size
        padded = self.buckets[bisect.bisect_left(self.buckets, bs)]
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        if padded > bs:
            self.req_pool_indices[bs:padded].fill_(self.pad_row)
            self.seq_lens[bs:padded].fill_(1)
            self.out_cache_loc[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.input_ids[bs:padded].zero_()
        self.graphs[padded].replay()
        logits = self.logits[:bs]
        return LogitsOutput(logits if fb.logits_idx is None else logits[fb.logits_idx], None)
