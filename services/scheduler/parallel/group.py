"""The collectives of one tensor-parallel group: torch.distributed's default process group over the
worker's ranks (NCCL on CUDA, gloo on CPU), started on a loopback TCP port rank 0 picked. One group
per process: a second tensor-parallel engine in the same process is refused until the first closes.

With one rank every collective is the identity, so the model code calls them unconditionally."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from services.scheduler.parallel.shard import SINGLE, Shard

# a collective waits this long for the other ranks (a rank that dies takes the worker down before:
# followers.py watches them)
_TIMEOUT = datetime.timedelta(minutes=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallel:
    def __init__(self, shard: Shard = SINGLE) -> None:
        self.shard = shard
        self.rank, self.size = shard.rank, shard.size

    @classmethod
    def start(cls, rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
        """Join the group (every rank calls this; it returns once all have)."""
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel group already runs in this process (one per process)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=_TIMEOUT
        )
        tp = cls(Shard(rank, size))
        tp.all_reduce(torch.zeros(1, device=device))  # NCCL sets up its communicator here, not in a capture
        return tp

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, size * C]: rank r's columns at r * C (the vocab-parallel logits)."""
        if self.size == 1:
            return x
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x.contiguous())
        return out.permute(1, 0, 2).reshape(x.shape[0], self.size * x.shape[1])  # (N may be 0)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, 0)
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


SINGLE_RANK = TensorParallel()
