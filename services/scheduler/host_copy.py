"""Small host lists to the device without a host sync: on CUDA through pinned memory and a
non-blocking copy (a copy from pageable memory makes the host wait, which would stall overlap
scheduling); on CPU a plain tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
