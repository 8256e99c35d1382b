"""The shared-prefix decode kernel's plan (sglbus_kernels/cascade_attention.py), importable without Triton:
the scheduler builds it (services/scheduler/cascade.py) and the ForwardBatch carries it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def block_r(device: torch.device, group: int) -> int:
    """Members per tile: 16 on the GPU (64 query rows for a GQA group of 4), fewer under the
    interpreter (so small tests span several tiles); never under 16 query rows (tl.dot's minimum)."""
    group_p = 1 << (group - 1).bit_length()
    return max(4 if device.type == "cpu" else 16, 16 // group_p)


@dataclass(frozen=True)
class CascadePlan:
    kv_starts: torch.Tensor  # [B] int64, each decode row's shared prefix length (0: none)
    members: torch.Tensor  # [M] int64, batch indices of the grouped requests, tile by tile
    tile_first: torch.Tensor  # [T] int64, each tile's first entry in members
    tile_count: torch.Tensor  # [T] int64, its size (<= block_r)
    tile_len: torch.Tensor  # [T] int64, its shared prefix length
    tile_row: torch.Tensor  # [T] int64, a req_to_token row that holds the prefix's slots
    num_tiles: int
    block_r: int
