"""KV memory: a token-level pool of KV slots and the request -> token table.

    KVPool.k[layer], .v[layer]   [num_slots + 1, kv_heads, head_dim]; slot 0 is padding, never handed out
    KVPool free list             int64 tensor of free slot indices; alloc takes from the front
    ReqToTokenPool.table         [rows, context_len] int64; row r holds the slot of every token of the
                                 request that owns row r (prefix from the radix cache, then its own)

A slot is always in exactly one place: the free list, the radix cache, or a running request's own
range (num_cached:num_computed of its row). `KVPool.check` adds the three up (`Scheduler.check_integrity`).
"""

from __future__ import annotations

import numpy as np
import torch

from shared.model_config import ModelConfig


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros. On CPU through calloc (numpy): the OS hands out zero pages as they are first written, so
    a pool holds memory for the slots in use, not all of it from the start (torch.zeros writes every
    page: a default-model engine took 3.3 GB of RSS for its pool before its first request)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.zeros(shape, dtype=np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.zeros(shape, dtype=torch.empty((), dtype=dtype).numpy().dtype))


class KVPool:
    def __init__(
        self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"KV pool needs at least one slot, got {num_slots}")
        self.size = num_slots
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_slots + 1, config.num_kv_heads, config.head_dim)
        self.k = [_zeros(shape, dtype, self.device) for _ in range(config.num_layers)]
        self.v = [_zeros(shape, dtype, self.device) for _ in range(config.num_layers)]
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        # freed slots wait here until an allocation needs them: one concatenation for many frees,
        # where concatenating at every free copied the whole free list (a million slots on a GPU)
        # for each finished request
        self._returned: list[torch.Tensor] = []
        self._returned_count = 0

    @property
    def free_count(self) -> int:
        return self._free.numel() + self._returned_count

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, or None when fewer are free (the caller evicts or retracts, then retries)."""
        if n > self._free.numel():
            if n > self.free_count:
                return None
            self._merge()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._returned.append(slots.to(self.device, torch.int64))
            self._returned_count += slots.numel()

    def free_slots(self) -> torch.Tensor:
        self._merge()
        return self._free

    def _merge(self) -> None:
        if self._returned:
            self._free = torch.cat((self._free, *self._returned))
            self._returned, self._returned_count = [], 0

    def check(self, cached: int, in_use: int, cached_slots: torch.Tensor | None) -> None:
        """free + cached + in use == pool size, else AssertionError; with the cache's slots (when no
        request runs) also that no slot is both free and cached."""
        free = self.free_count
        if free + cached + in_use != self.size:
            raise AssertionError(
                f"KV leak: free {free} + cached {cached} + in use {in_use} != pool {self.size}"
            )
        if (
            cached_slots is not None
            and torch.cat((self.free_slots(), cached_slots)).unique().numel() != self.size
        ):
            raise AssertionError("KV slots duplicated between the free list and the cache")


class ReqToTokenPool:
    """Rows of slot indices, one row per running request. The last row is never handed out: it stays
    all zeros (slot 0), for the padding rows of a CUDA-graph batch.

    Besides each step's new slots (`ForwardBatch.store_slots`), the scheduler writes rows through
    `write`; with `journal` on, those writes are kept until `take_journal`, so a tensor-parallel
    follower's copy of the table makes the same writes before the next step."""

    def __init__(
        self, rows: int, context_len: int, device: torch.device | str, journal: bool = False
    ) -> None:
        self.table = torch.zeros((rows, context_len), dtype=torch.int64, device=device)
        self.padding_row = rows - 1
        self._free_rows = list(range(rows - 2, -1, -1))
        self._journal: list[tuple[int, int, torch.Tensor]] | None = [] if journal else None

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """table[row, start : start + len(slots)] = slots."""
        self.table[row, start : start + slots.numel()] = slots
        if self._journal is not None:
            self._journal.append((row, start, slots))

    def take_journal(self) -> list[tuple[int, int, torch.Tensor]]:
        """The writes since the last call, in order: (row, start, slots)."""
        out, self._journal = self._journal or [], [] if self._journal is not None else None
        return out

    @property
    def free_count(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)
